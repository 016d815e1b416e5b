"""The context and vocabulary checks (`replicas/limits.py`), and the engine applying them to
every request it queues, whoever sends it."""

from __future__ import annotations

import re

import pytest

from replicas.engine import RequestRejected
from replicas.limits import EngineLimits, LimitExceeded
from replicas.request import Request
from tests.replicas.conftest import greedy, make_engine

LIMITS = EngineLimits(max_model_len=16, vocab_size=100)


class TestEngineLimits:
    def test_a_null_max_tokens_takes_what_the_context_leaves(self):
        assert LIMITS.output_budget([1, 2, 3], None, prompt_param="prompt") == 13
        assert LIMITS.output_budget([1, 2, 3], 13, prompt_param="prompt") == 13

    def test_a_prompt_that_leaves_no_room_names_the_prompt(self):
        with pytest.raises(LimitExceeded) as refused:
            LIMITS.output_budget([1] * 16, None, prompt_param="messages")
        assert (refused.value.param, refused.value.code) == ("messages", "context_length_exceeded")
        assert "your prompt has 16 tokens" in refused.value.message

    def test_max_tokens_past_the_context_names_max_tokens(self):
        with pytest.raises(LimitExceeded) as refused:
            LIMITS.output_budget([1] * 10, 7, prompt_param="prompt")
        assert (refused.value.param, refused.value.code) == (
            "max_tokens",
            "context_length_exceeded",
        )
        assert "you requested 17 tokens (10 in the prompt, 7 for the completion)" in str(
            refused.value
        )

    def test_an_empty_prompt_is_refused(self):
        with pytest.raises(LimitExceeded, match="the prompt is empty"):
            LIMITS.output_budget([], 4, prompt_param="prompt")

    @pytest.mark.parametrize("token", [-1, 100, 2**40])
    def test_a_token_outside_the_vocabulary_is_named(self, token):
        with pytest.raises(LimitExceeded) as refused:
            LIMITS.output_budget([5, token, 7], 2, prompt_param="prompt")
        assert str(refused.value) == f"token id {token} is outside the vocabulary (0..99)"
        assert refused.value.param == "prompt"

    def test_stop_token_ids_are_checked_too(self):
        LIMITS.check_request([1, 2], greedy(2, stop_token_ids=(99,)))
        with pytest.raises(LimitExceeded, match="stop token id 100 is outside") as refused:
            LIMITS.check_request([1, 2], greedy(2, stop_token_ids=(100,)))
        assert refused.value.param == "stop_token_ids"


class TestTheEngineAppliesThem:
    """A caller in the same process (the benchmark driver, a test) gets the ingress's refusal
    too, and nothing reaches the model."""

    @pytest.fixture(scope="class")
    def engine(self, models):
        return make_engine(models["llama"], max_model_len=32)

    @pytest.mark.parametrize(
        ("prompt", "params", "message"),
        [
            ([1, 2, 300], greedy(4), "token id 300 is outside the vocabulary (0..258)"),
            ([1, -2], greedy(4), "token id -2 is outside the vocabulary (0..258)"),
            (
                [1] * 30,
                greedy(3),
                "you requested 33 tokens (30 in the prompt, 3 for the completion)",
            ),
            ([1] * 32, greedy(1), "your prompt has 32 tokens, which leaves no room"),
            ([1, 2], greedy(4, stop_token_ids=(259,)), "stop token id 259 is outside"),
        ],
    )
    def test_a_request_past_the_limits_is_refused_before_it_queues(
        self, engine, prompt, params, message
    ):
        with pytest.raises(RequestRejected, match=re.escape(message)):
            engine.add_request(Request("r", prompt, params))
        assert not engine.has_work
