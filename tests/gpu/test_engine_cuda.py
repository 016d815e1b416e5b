"""The engine on a GPU against transformers + PEFT: bf16 logits close to transformers' bf16;
float32 greedy tokens equal to the float32 reference's; bf16 greedy tokens equal to the float32
reference's at every step whose top-2 lead exceeds the measured bf16 error (reference.py)."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.reference import (
    assert_bf16_greedy_agrees,
    bf16_agreement,
    engine_logits,
    full_float32,
    hf_model,
    reference_greedy,
    teacher_forced_logits,
)
from tests.replicas.conftest import forward_logits, run_to_completion

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7, 12, 250, 3, 44]
LONG = [(7 * i + 3) % 251 + 2 for i in range(40)]
# request id -> (with the adapter?, prompt)
REQUESTS = {"a": (True, PROMPT), "b": (False, PROMPT), "c": (True, LONG), "d": (False, LONG)}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_logits_close_to_transformers(tmp_path, arch):
    model_dir = make_model(
        tmp_path / "m",
        arch=arch,
        hidden_size=256,
        intermediate_size=512,
        num_heads=8,
        num_kv_heads=2,
    )
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", num_kv_blocks=64))
    ours = forward_logits(engine, [PROMPT[:7], PROMPT[7:]])
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([PROMPT]).cuda()).logits[0]
    assert rel_err(ours, ref) < 2e-2


def greedy_engine(tmp_path, dtype: str):
    """A model and a rank-8 adapter; REQUESTS' 16 greedy tokens from the engine in `dtype`."""
    model_dir = make_model(
        tmp_path / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapter = make_adapter(
        model_dir, tmp_path / "a", rank=8, lora_alpha=16, target_modules=ALL, seed=1
    )
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            num_kv_blocks=64,
            dtype=dtype,
            adapters=(("a", str(adapter)),),
        )
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = [
        Request(rid, prompt, params, "a" if lora else None)
        for rid, (lora, prompt) in REQUESTS.items()
    ]
    got = {rid: tokens for rid, (tokens, _) in run_to_completion(engine, requests).items()}
    return engine, model_dir, adapter, got


def test_fp32_greedy_with_adapters_equals_peft(tmp_path):
    with full_float32():
        _, model_dir, adapter, got = greedy_engine(tmp_path, "float32")
        for rid, (lora, prompt) in REQUESTS.items():
            model = hf_model(model_dir, adapter if lora else None, torch.float32)
            assert got[rid] == reference_greedy(model, prompt, len(got[rid])), rid


def test_bf16_greedy_with_adapters_agrees_with_peft(tmp_path):
    engine, model_dir, adapter, got = greedy_engine(tmp_path, "bfloat16")
    agreements = {}
    with full_float32():
        for rid, (lora, prompt) in REQUESTS.items():
            model = hf_model(model_dir, adapter if lora else None, torch.float32)
            tokens = prompt + got[rid]
            agreements[rid] = bf16_agreement(
                teacher_forced_logits(model, tokens),
                engine_logits(engine, "a" if lora else None, tokens),
                len(prompt),
                got[rid],
            )
    assert_bf16_greedy_agrees(agreements)
