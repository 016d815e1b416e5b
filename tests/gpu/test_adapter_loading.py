"""Adapter loading on the GPU: packed one-copy-per-layer writes leave a slot exactly as the
module-by-module write does; requests admitted while copies are in flight (per-layer events,
the long-copy admission rule forced on), and requests that arrive while a step runs (their
copies start beside that step, ordered only after the last step that read their slot), still
answer what transformers + PEFT answer."""

import time

import pytest
import torch

from replicas.adapters.loader import load_adapter
from replicas.adapters.policy import CopyBudget
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.reference import (
    assert_bf16_greedy_agrees,
    bf16_agreement,
    engine_logits,
    full_float32,
    hf_model,
    teacher_forced_logits,
)

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7]


def test_packed_write_equals_module_write_on_the_load_stream(tmp_path):
    model_dir = make_model(
        tmp_path / "m", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2
    )
    spec = ModelSpec.from_dir(model_dir)
    adapter = make_adapter(model_dir, tmp_path / "a", rank=8, target_modules=ALL, seed=3)
    weights = load_adapter("a", adapter, spec, 8, torch.bfloat16)
    device = torch.device("cuda")
    packed_pool = LoraWeightPool(spec, 2, 8, torch.bfloat16, device, "triton")
    module_pool = LoraWeightPool(spec, 2, 8, torch.bfloat16, device, "triton")
    packed = packed_pool.pack(weights)
    assert packed.layers is not None and packed.layers[0].is_pinned()
    for layer in packed_pool.layers:
        layer.fill_(float("nan"))  # poison: the packed write must cover the whole slot
    stream = torch.cuda.Stream()
    events = packed_pool.write(1, packed, stream)
    assert len(events) == spec.num_layers
    events[-1].synchronize()
    module_pool.write(1, weights.pinned(), stream)
    torch.cuda.synchronize()
    for got, want in zip(packed_pool.layers, module_pool.layers, strict=True):
        assert torch.equal(got[1], want[1])
        assert got[0].isnan().all()  # and nothing beyond it


def churning_engine(tmp_path, count: int, seed: int, slots: int = 2) -> tuple[Engine, dict]:
    """A small model on the GPU with `count` rank-8 adapters over `slots` slots."""
    model_dir = make_model(
        tmp_path / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapters = {
        f"a{i}": make_adapter(
            model_dir, tmp_path / f"a{i}", rank=8, lora_alpha=16, target_modules=ALL, seed=seed + i
        )
        for i in range(count)
    }
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            num_kv_blocks=128,
            max_loras_per_batch=slots,
            max_lora_rank=8,
            adapters=tuple((k, str(v)) for k, v in adapters.items()),
        )
    )
    return engine, adapters


def assert_matches_peft(
    engine, adapters: dict, tokens: dict[str, list[int]], names: dict[str, str]
) -> None:
    """Each request's tokens (request id -> adapter name in `names`) against transformers +
    PEFT in float32, at every step the engine's bf16 rounding cannot flip (reference.py)."""
    agreements = {}
    with full_float32():
        for name, path in adapters.items():
            model = hf_model(engine.config.model, path, torch.float32)
            for rid in [r for r, n in names.items() if n == name]:
                seq = PROMPT + tokens[rid]
                agreements[rid, name] = bf16_agreement(
                    teacher_forced_logits(model, seq),
                    engine_logits(engine, name, seq),
                    len(PROMPT),
                    tokens[rid],
                )
    assert_bf16_greedy_agrees(agreements)


def test_requests_admitted_during_copies_match_peft(tmp_path, monkeypatch):
    # Every copy counts as longer than a step: requests wait for their adapters' middle layers.
    engine, adapters = churning_engine(tmp_path, 4, seed=10)
    monkeypatch.setattr(engine.adapters, "budget", CopyBudget(copy_bytes_per_s=1.0))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("a0", PROMPT, params, "a0"))
    engine.step()  # a0 runs; the others arrive while it does and need copies
    for name in ("a1", "a2", "a3"):
        engine.add_request(Request(name, PROMPT, params, name))
    tokens = {f"a{i}": [] for i in range(4)}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert_matches_peft(engine, adapters, tokens, {name: name for name in adapters})


def test_requests_arriving_mid_step_match_peft(tmp_path):
    # 4 slots: the first arrivals find free slots mid-step; later ones wait for slots to free
    engine, adapters = churning_engine(tmp_path, 5, seed=20, slots=4)
    for name in adapters:  # in host memory, so every load is a copy on the load stream
        while not engine.adapters.prepare(name):
            time.sleep(0.005)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    order = ["a0", "a1", "a2", "a3", "a4", "a0", "a2"]
    arrivals = [Request(f"r{i}", PROMPT, params, name) for i, name in enumerate(order)]
    engine.add_request(arrivals.pop(0))

    def on_idle():  # one arrival per step, handed over while the step runs
        if on_idle.loads is None:
            on_idle.loads = engine.adapters.stats.gpu_loads
        if arrivals and not on_idle.done:
            engine.add_request(arrivals.pop(0))
            on_idle.done = True

    tokens = {f"r{i}": [] for i in range(len(order))}
    mid_step_loads = 0
    while engine.has_work or arrivals:
        on_idle.done, on_idle.loads = False, None
        for out in engine.step(on_idle=on_idle):
            tokens[out.request_id] += out.new_token_ids
        if on_idle.loads is not None:
            mid_step_loads += engine.adapters.stats.gpu_loads - on_idle.loads
        if not engine.has_work and arrivals:
            engine.add_request(arrivals.pop(0))
    assert mid_step_loads >= 3  # copies started while steps ran, not only at their starts
    assert_matches_peft(engine, adapters, tokens, {f"r{i}": n for i, n in enumerate(order)})
