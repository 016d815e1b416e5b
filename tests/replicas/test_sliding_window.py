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


def qwen_window_config(num_layers: int, max_window_layers: int, with_layer_types: bool) -> dict:
    """Qwen2's sliding-window switches as transformers writes them: layers from
    `max_window_layers` on slide; newer configs also list `layer_types`, older ones do not."""
    types = [
        "sliding_attention" if i >= max_window_layers else "full_attention"
        for i in range(num_layers)
    ]
    return dict(
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=max_window_layers,
        layer_types=types if with_layer_types else None,
    )


@pytest.mark.parametrize("with_layer_types", [True, False], ids=["layer_types", "older-config"])
@pytest.mark.parametrize("max_window_layers,window", [(0, WINDOW), (2, None)])
def test_qwen2_slides_exactly_where_transformers_does(
    models, tmp_path, max_window_layers, window, with_layer_types
):
    """Qwen2 with `use_sliding_window`: every layer from `max_window_layers` on slides (0: all of
    the test model's two layers; 2: none)."""
    config = qwen_window_config(2, max_window_layers, with_layer_types)
    model_dir = copy_model(models["qwen2"], tmp_path / "m", **config)
    assert ModelSpec.from_dir(model_dir).sliding_window == window
    engine = make_engine(model_dir, max_num_batched_tokens=7)
    results = run_to_completion(engine, [Request("a", PROMPT, greedy(10))])
    assert results["a"][0] == hf_greedy(model_dir, PROMPT, 10)


def test_layers_mixing_window_and_full_attention_are_refused(models, tmp_path):
    config = qwen_window_config(2, 1, with_layer_types=True)
    model_dir = copy_model(models["qwen2"], tmp_path / "m", **config)
    with pytest.raises(ValueError, match="sliding"):
        make_engine(model_dir)
