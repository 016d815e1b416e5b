"""Adapter loading on the GPU: packed one-copy-per-layer writes leave a slot exactly as the
module-by-module write does; requests admitted while copies are in flight (per-layer events,
the long-copy admission rule forced on), and requests that arrive while a step runs (their
copies start beside that step, ordered only after the last step that read their slot), still
answer what transformers + PEFT answer."""

import time

import pytest
import torch

from replicas.adapters import manager as manager_module
from replicas.adapters.loader import load_adapter
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7]


def test_packed_write_equals_module_write_on_the_load_stream(tmp_path):
    model_dir = make_model(tmp_path / "m", hidden_size=128, intermediate_size=256, num_heads=4,
                           num_kv_heads=2)
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


def churning_engine(tmp_path, count: int, seed: int) -> tuple[Engine, dict]:
    """A small model on the GPU with `count` rank-8 adapters over 2 slots."""
    model_dir = make_model(tmp_path / "m", hidden_size=256, intermediate_size=512, num_heads=8,
                           num_kv_heads=2)
    adapters = {
        f"a{i}": make_adapter(model_dir, tmp_path / f"a{i}", rank=8, lora_alpha=16,
                              target_modules=ALL, seed=seed + i)
        for i in range(count)
    }
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", num_kv_blocks=128,
                                 max_loras_per_batch=2, max_lora_rank=8,
                                 adapters=tuple((k, str(v)) for k, v in adapters.items())))
    return engine, adapters


def peft_greedy(model_dir, adapters: dict, max_new_tokens: int) -> dict[str, list[int]]:
    """Each adapter's greedy continuation of PROMPT under transformers + PEFT in bf16."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    want = {}
    for name, path in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
        model = PeftModel.from_pretrained(base, path).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]).cuda(), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False)
        want[name] = out[0, len(PROMPT):].tolist()
    return want


def test_requests_admitted_during_copies_match_peft(tmp_path, monkeypatch):
    # Every copy counts as longer than a step: requests wait for their adapters' middle layers.
    monkeypatch.setattr(manager_module, "COPY_BYTES_PER_S", 1.0)
    engine, adapters = churning_engine(tmp_path, 4, seed=10)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("a0", PROMPT, params, "a0"))
    engine.step()  # a0 runs; the others arrive while it does and need copies
    for name in ("a1", "a2", "a3"):
        engine.add_request(Request(name, PROMPT, params, name))
    tokens = {f"a{i}": [] for i in range(4)}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    want = peft_greedy(engine.config.model, adapters, 6)
    for name in adapters:
        # bf16 rounding may flip a near-tie late in the sequence; the first tokens must agree.
        assert tokens[name][:3] == want[name][:3], name


def test_requests_arriving_mid_step_match_peft(tmp_path):
    engine, adapters = churning_engine(tmp_path, 5, seed=20)
    for name in adapters:  # in host memory, so every load is a copy on the load stream
        while not engine.adapters.prepare(name):
            time.sleep(0.005)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    order = ["a0", "a1", "a2", "a3", "a4", "a0", "a2"]
    arrivals = [Request(f"r{i}", PROMPT, params, name) for i, name in enumerate(order)]
    engine.add_request(arrivals.pop(0))

    def on_idle():  # one arrival per step, handed over while the step runs
        if arrivals and not on_idle.done:
            engine.add_request(arrivals.pop(0))
            on_idle.done = True

    tokens = {f"r{i}": [] for i in range(len(order))}
    while engine.has_work or arrivals:
        on_idle.done = False
        for out in engine.step(on_idle=on_idle):
            tokens[out.request_id] += out.new_token_ids
        if not engine.has_work and arrivals:
            engine.add_request(arrivals.pop(0))
    assert engine.adapters.stats.prefetch_loads >= 3  # loads did start during steps
    want = peft_greedy(engine.config.model, adapters, 6)
    for i, name in enumerate(order):
        # bf16 rounding may flip a near-tie late in the sequence; the first tokens must agree.
        assert tokens[f"r{i}"][:3] == want[name][:3], (i, name)
