"""Checkpoint layouts as transformers writes them, against transformers on the same folder (CPU,
float32): a model saved in several shards with `model.safetensors.index.json`."""

import json

import pytest
import torch

from replicas.request import Request
from tests.factories import hf_greedy, hf_logits, save_sharded
from tests.replicas.conftest import forward_logits, greedy, make_engine, run_to_completion

PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7, 12, 250, 3, 44]


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2"])
def test_sharded_checkpoint_equals_transformers(models, tmp_path, arch):
    model_dir = save_sharded(models[arch], tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and not (model_dir / "model.safetensors").exists()
    # Some fused projection (q/k/v or gate/up) is filled from two shards.
    split = [
        (layer, a)
        for layer in range(2)
        for a, b in [("self_attn.q_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]
        if index["weight_map"][f"model.layers.{layer}.{a}.weight"]
        != index["weight_map"][f"model.layers.{layer}.{b}.weight"]
    ]
    assert split

    engine = make_engine(model_dir)
    ours = forward_logits(engine, [PROMPT[:6], PROMPT[6:]])
    torch.testing.assert_close(ours, hf_logits(model_dir, PROMPT), rtol=1e-5, atol=1e-5)
    results = run_to_completion(engine, [Request("a", PROMPT, greedy(10))])
    assert results["a"][0] == hf_greedy(model_dir, PROMPT, 10)
