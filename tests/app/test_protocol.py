"""OpenAI request parsing and response serialization."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    CompletionRequest,
    DeltaMessage,
)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


class TestCompletionRequest:
    def test_defaults(self):
        request = completion()
        assert request.max_tokens == 16
        assert (request.temperature, request.top_p, request.top_k_or_none) == (None, None, None)
        assert request.stop_strings == []
        assert not request.stream and not request.include_usage

    @pytest.mark.parametrize(
        ("prompt", "parsed"),
        [("text", "text"), ([1, 2], [1, 2]), (["text"], "text"), ([[1, 2]], [1, 2])],
    )
    def test_one_prompt_in_any_form(self, prompt, parsed):
        assert completion(prompt=prompt).prompt == parsed

    @pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
    def test_batches_are_refused(self, prompt):
        with pytest.raises(ValidationError, match="batched prompts are not supported"):
            completion(prompt=prompt)

    @pytest.mark.parametrize("prompt", [[], [[]]])
    def test_empty_token_prompt_is_refused(self, prompt):
        with pytest.raises(ValidationError, match="must not be empty"):
            completion(prompt=prompt)

    def test_stop_as_string_or_list(self):
        assert completion(stop="END").stop_strings == ["END"]
        assert completion(stop=["a", "b"]).stop_strings == ["a", "b"]
        with pytest.raises(ValidationError, match="at most 4"):
            completion(stop=["1", "2", "3", "4", "5"])
        with pytest.raises(ValidationError, match="non-empty"):
            completion(stop=[""])

    @pytest.mark.parametrize(
        ("fields", "words"),
        [
            ({"n": 3}, "only n=1"),
            ({"echo": True}, "echo"),
            ({"logprobs": 2}, "logprobs"),
            ({"best_of": 2}, "best_of"),
            ({"presence_penalty": 0.5}, "penalties"),
            ({"logit_bias": {"1": 2.0}}, "logit_bias"),
            ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
        ],
    )
    def test_unsupported_options_are_refused_with_a_reason(self, fields, words):
        with pytest.raises(ValidationError, match=words):
            completion(**fields)

    def test_neutral_values_of_unsupported_options_are_accepted(self):
        request = completion(n=1, echo=False, logprobs=None, best_of=1, presence_penalty=0)
        assert request.n == 1

    def test_unknown_fields_are_ignored(self):
        assert completion(some_future_field=1).model == "m"

    @pytest.mark.parametrize(("top_k", "parsed"), [(None, None), (-1, None), (0, None), (5, 5)])
    def test_top_k_off_values(self, top_k, parsed):
        assert completion(top_k=top_k).top_k_or_none == parsed

    def test_include_usage(self):
        assert completion(stream=True, stream_options={"include_usage": True}).include_usage


class TestChatCompletionRequest:
    def test_content_parts_join_into_text(self):
        request = chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        )
        assert request.messages[0].text == "a\nb"

    def test_non_text_parts_are_refused(self):
        with pytest.raises(ValidationError, match="only text content parts"):
            chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}])

    def test_unknown_role_is_refused(self):
        with pytest.raises(ValidationError):
            chat(messages=[{"role": "wizard", "content": "x"}])

    def test_messages_must_not_be_empty(self):
        with pytest.raises(ValidationError):
            chat(messages=[])

    def test_max_completion_tokens_wins_over_max_tokens(self):
        assert chat().output_token_limit is None
        assert chat(max_tokens=5).output_token_limit == 5
        assert chat(max_tokens=5, max_completion_tokens=7).output_token_limit == 7

    @pytest.mark.parametrize(
        "fields",
        [
            {"logprobs": True},
            {"tools": [{"type": "function"}]},
            {"response_format": {"type": "json_object"}},
        ],
    )
    def test_unsupported_options_are_refused(self, fields):
        with pytest.raises(ValidationError, match="not supported"):
            chat(**fields)


class TestResponses:
    def test_delta_carries_only_what_changed(self):
        assert DeltaMessage(content="x").model_dump() == {"content": "x"}
        assert DeltaMessage().model_dump() == {}
        choice = ChatCompletionStreamChoice(delta=DeltaMessage(), finish_reason="stop")
        assert choice.model_dump() == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
        }

    def test_error_body_has_openai_shape(self):
        body = APIError("nope", 404, code="model_not_found", param="model").to_response()
        assert body.model_dump() == {
            "error": {
                "message": "nope",
                "type": "NotFoundError",
                "param": "model",
                "code": "model_not_found",
            }
        }


# Each unsupported field with a value it refuses, and the whole message the client reads.
REFUSED = {
    "completion": [
        ("n", 3, "only n=1 is supported, got 3"),
        ("presence_penalty", 0.5, "presence and frequency penalties are not supported (only 0)"),
        ("frequency_penalty", -1.0, "presence and frequency penalties are not supported (only 0)"),
        ("logit_bias", {"1": 2.0}, "logit_bias is not supported"),
        ("echo", True, "echo is not supported"),
        ("logprobs", 2, "logprobs is not supported (only null)"),
        ("best_of", 2, "best_of is not supported (only 1)"),
        ("suffix", "x", "suffix is not supported"),
    ],
    "chat": [
        ("n", 2, "only n=1 is supported, got 2"),
        ("logprobs", True, "logprobs is not supported (only false)"),
        ("top_logprobs", 3, "top_logprobs is not supported"),
        ("tools", [{"type": "function"}], "tools are not supported"),
        ("tool_choice", "required", "tool_choice is not supported (tools are not supported)"),
        (
            "response_format",
            {"type": "json_object"},
            "response_format is not supported (only {'type': 'text'})",
        ),
    ],
}


class TestUnsupportedFields:
    @pytest.mark.parametrize(
        ("kind", "field", "value", "message"),
        [(kind, *case) for kind, cases in REFUSED.items() for case in cases],
    )
    def test_each_is_refused_on_its_own_field_with_its_message(self, kind, field, value, message):
        build = completion if kind == "completion" else chat
        with pytest.raises(ValidationError) as info:
            build(**{field: value})
        (error,) = info.value.errors()
        assert error["loc"] == (field,)
        assert error["msg"] == f"Value error, {message}"

    def test_neutral_values_are_accepted(self):
        neutral = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}}
        request = completion(**neutral, echo=False, logprobs=None, best_of=None, suffix="")
        assert (request.n, request.echo, request.best_of) == (1, False, None)
        for tool_choice, response_format in [("none", {"type": "text"}), ("auto", None)]:
            request = chat(
                logprobs=False,
                top_logprobs=0,
                tools=[],
                tool_choice=tool_choice,
                response_format=response_format,
            )
            assert request.tool_choice == tool_choice
