"""Sliding-window attention that is active (a window shorter than prompt + output), against
transformers on the same weights (CPU, float32, eager attention)."""

import pytest
import torch

from replicas.models.spec import ModelSpec
from replicas.request import Request
from tests.factories import copy_model, hf_greedy, hf_logits
from tests.replicas.conftest import forward_logits, greedy, make_engine, run_to_completion

WINDOW = 8
PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7, 12, 250, 3, 44, 9, 100, 2, 77, 13, 8, 8, 91, 120]


@pytest.fixture(scope="module")
def windowed(models, tmp_path_factory):
    """The mistral test model with a window of 8 tokens."""
    return copy_model(models["mistral"], tmp_path_factory.mktemp("sw") / "m", sliding_window=WINDOW)


def test_transformers_applies_the_window(models, windowed):
    """The reference depends on the window, so an engine that ignores it cannot match."""
    assert ModelSpec.from_dir(windowed).sliding_window == WINDOW
    ref = hf_logits(windowed, PROMPT)
    full = hf_logits(models["mistral"], PROMPT)  # window 4096: nothing masked
    torch.testing.assert_close(ref[:WINDOW], full[:WINDOW], rtol=1e-5, atol=1e-5)
    assert (ref[WINDOW:] - full[WINDOW:]).abs().amax(-1).min() > 1e-2  # every later position
    assert hf_greedy(windowed, PROMPT, 12) != hf_greedy(models["mistral"], PROMPT, 12)


def test_greedy_tokens_equal_transformers(windowed):
    """Prefill chunks of 7 tokens over blocks of 4 (a chunk's queries see keys across the window
    edge, in the cache and in the chunk), then decodes far past the window."""
    engine = make_engine(windowed, max_num_batched_tokens=7)
    prompts = {"long": PROMPT, "mid": PROMPT[5:19], "short": PROMPT[:3]}
    results = run_to_completion(engine, [Request(k, p, greedy(14)) for k, p in prompts.items()])
    for rid, prompt in prompts.items():
        assert results[rid][0] == hf_greedy(windowed, prompt, 14), rid


def test_chunked_prefill_logits_equal_transformers(windowed):
    engine = make_engine(windowed)
    chunks = [PROMPT[:5], PROMPT[5:13], PROMPT[13:14], PROMPT[14:]]
    ours = forward_logits(engine, chunks)
    torch.testing.assert_close(ours, hf_logits(windowed, PROMPT), rtol=1e-5, atol=1e-5)
