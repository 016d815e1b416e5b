"""Steady-state steps -- decodes, and prefills joining running decodes -- must not synchronize
the host with the device, except for the one event wait that brings the sampled tokens back."""

import time

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine_with_adapters(tmp_path, count: int, **config) -> tuple[Engine, list[str]]:
    """A small model on the GPU serving `count` adapters of ranks 4, 8, ..."""
    model_dir = make_model(
        tmp_path / "m", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2
    )
    adapters = tuple(
        (
            f"a{i}",
            str(
                make_adapter(
                    model_dir, tmp_path / f"a{i}", rank=4 * (i + 1), target_modules=ALL, seed=i
                )
            ),
        )
        for i in range(count)
    )
    engine = Engine(
        EngineConfig(
            model=str(model_dir), device="cuda", num_kv_blocks=256, adapters=adapters, **config
        )
    )
    return engine, [name for name, _ in adapters]


def step_until_all_sampled(engine: Engine, requests: list[Request], timeout_s: float = 60) -> None:
    """Step until every request has a token: its adapter read from disk (on a worker thread,
    however long that takes) and loaded, its prefill run, kernels warm."""
    deadline = time.monotonic() + timeout_s
    while not all(r.output_token_ids for r in requests):
        assert time.monotonic() < deadline, "requests never got their first token"
        engine.step()
        if engine.stalled:
            time.sleep(0.001)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_run_under_sync_debug_error(tmp_path, temperature):
    engine, adapters = engine_with_adapters(tmp_path, 3)
    params = SamplingParams(
        max_tokens=64, temperature=temperature, top_p=0.9, top_k=50, ignore_eos=True
    )
    requests = []
    for i in range(6):
        adapter = None if i % 4 == 3 else adapters[i % 3]
        seed = i if i % 2 else None
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        requests.append(Request(f"r{i}", [5 + i, 6, 7, 8], p, adapter))
        engine.add_request(requests[-1])
    step_until_all_sampled(engine, requests)  # adapters loaded, prefills done
    for _ in range(2):  # the first decodes: caches warm up
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode is live: a plain readback is refused
            torch.ones(1, device="cuda").item()
        for _ in range(8):
            outputs = engine.step()
            assert len(outputs) == 6
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Nor does the next step's reset of the pinned metadata wait: the readback covered its copies.
    torch.cuda._sleep(1_000_000_000)
    engine.runner.staging.reset()
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()


@pytest.mark.parametrize("graph_tokens", [0, 64], ids=["eager", "graphs"])
def test_prefill_steps_run_under_sync_debug_error(tmp_path, graph_tokens):
    # A small token budget splits the long prompt into chunks: chunked prefill is checked too.
    engine, adapters = engine_with_adapters(
        tmp_path, 2, max_num_batched_tokens=64, max_prefill_graph_tokens=graph_tokens
    )
    assert (engine.runner.prefill_graphs is None) == (graph_tokens == 0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    warm = [Request(f"warm{i}", [5, 6, 7], params, name) for i, name in enumerate(adapters)]
    for request in warm:
        engine.add_request(request)
    step_until_all_sampled(engine, warm)  # adapters resident, kernels warm
    engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prompts = [list(range(10, 50)), list(range(3, 150)), list(range(60, 77))]
        for i, prompt in enumerate(prompts):
            adapter = adapters[i] if i < len(adapters) else None
            engine.add_request(Request(f"p{i}", prompt, params, adapter))
        firsts = set()
        for _ in range(8):  # prefills and chunks next to the warm requests' decodes
            firsts |= {o.request_id for o in engine.step() if o.new_token_ids}
        assert {"p0", "p1", "p2"} <= firsts
    finally:
        torch.cuda.set_sync_debug_mode("default")
