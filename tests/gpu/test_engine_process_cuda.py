"""The engine loop in a process of its own (`engine_process`) on a GPU: the child builds the
engine on CUDA, and its float32 greedy tokens, streamed back one message a step, equal
transformers + PEFT's. The child runs with torch's defaults (TF32 off for matmuls), as the
reference does inside `full_float32`. Synchronous, with `asyncio.run`: the GPU image has no
pytest-asyncio."""

import asyncio

import pytest
import torch

from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.engine_core import build_core
from replicas.engine_process import ProcessCore
from replicas.protocol import GenerateRequest
from replicas.request import SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.reference import full_float32, hf_model, reference_greedy

pytestmark = pytest.mark.gpu

PROMPTS = {"a": [5, 17, 200, 33, 98, 4, 61], "b": [150, 7, 12, 250, 3, 44, 9, 9]}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 12


def test_the_engine_process_on_cuda_streams_pefts_greedy_tokens(tmp_path):
    model_dir = make_model(
        tmp_path / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapter = make_adapter(
        model_dir, tmp_path / "a", rank=8, lora_alpha=16, target_modules=ALL, seed=1
    )
    config = EngineConfig(
        model=str(model_dir), device="cuda", num_kv_blocks=64, dtype="float32",
        adapters=(("a", str(adapter)),), engine_process=True,
    )  # fmt: skip
    core, _ = build_core(config)
    assert isinstance(core, ProcessCore)
    got = asyncio.run(stream_all(AsyncEngine(core, stream_interval_s=0.0)))
    with full_float32():
        for rid, prompt in PROMPTS.items():
            model = hf_model(model_dir, adapter if rid == "a" else None, torch.float32)
            assert got[rid] == reference_greedy(model, prompt, MAX_TOKENS), rid


async def stream_all(engine: AsyncEngine) -> dict[str, list[int]]:
    """Each prompt's tokens, one request after another (`a` on the adapter)."""
    engine.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = {}
    try:
        for rid, prompt in PROMPTS.items():
            request = GenerateRequest(rid, prompt, params, "a" if rid == "a" else None)
            got[rid] = [t async for chunk in engine.generate(request) for t in chunk.token_ids]
    finally:
        engine.shutdown()
    return got
