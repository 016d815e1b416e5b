"""The whole engine on the Triton kernels (SGMV, paged attention, layer ops) against
transformers + PEFT: a mixed-adapter batch with prefill chunks and decodes, greedy, token for
token. Without a GPU the kernels run in Triton's interpreter in float32, so this checks how the
model wires them (views into the fused q/k/v buffer, strides, segment layout) before a GPU does.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from replicas.config import EngineConfig  # noqa: E402
from replicas.engine import Engine  # noqa: E402
from replicas.request import Request, SamplingParams  # noqa: E402
from tests.factories import hf_greedy, make_adapter, make_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 200, 33, 98, 4, 61, 150, 7], [8, 8, 8], [100, 2, 77, 13, 250, 3]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests cover the compiled kernels")
def test_greedy_on_triton_kernels_matches_peft(tmp_path):
    model_dir = make_model(tmp_path / "m", hidden_size=64, intermediate_size=96, num_heads=4,
                           num_kv_heads=2)
    adapters = {
        "all-r8": make_adapter(model_dir, tmp_path / "a", rank=8, lora_alpha=16,
                               target_modules=ALL, seed=1),
        "qv-r4": make_adapter(model_dir, tmp_path / "b", rank=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj"], seed=2),
    }
    engine = Engine(EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=64, block_size=4,
        max_num_batched_tokens=12,  # prompts split into chunks, mixed with decodes
        max_lora_rank=8, adapters=tuple((k, str(v)) for k, v in adapters.items()),
        sgmv_backend="triton", attention_backend="triton", layer_ops_backend="triton",
    ))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [("all-r8", 0), ("qv-r4", 1), (None, 2), ("all-r8", 1)]
    for i, (adapter, p) in enumerate(requests):
        engine.add_request(Request(str(i), PROMPTS[p], params, adapter))
    tokens = {str(i): [] for i in range(len(requests))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.max_adapters_in_step == 2
    for i, (adapter, p) in enumerate(requests):
        adapter_dir = adapters[adapter] if adapter else None
        assert tokens[str(i)] == hf_greedy(model_dir, PROMPTS[p], 4, adapter_dir), (adapter, p)
