"""Adapters evicted from their GPU slots and loaded again answer what transformers + PEFT answer
(float32, exact greedy tokens), in every loading mode, with a host cache that holds every
adapter and with one smaller than the set (evicted adapters are read from disk again).

Six adapters of mixed ranks share two slots. Round 1 uses each once; round 2 again (those no
longer in a slot load again); round 3 uses the adapters still loaded only once, which round 2's
loads have evicted. Every adapter is thus used, evicted and loaded again before its last use."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.reference import full_float32, hf_model, reference_greedy
from tests.replicas.conftest import run_to_completion

pytestmark = pytest.mark.gpu

ADAPTERS = {
    "a4": dict(rank=4),
    "a8-qv": dict(rank=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "a16-rslora": dict(rank=16, lora_alpha=8, use_rslora=True),
    "a32-mlp": dict(rank=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "a64": dict(rank=64, lora_alpha=16),
    "a12-pattern": dict(rank=12, rank_pattern={"k_proj": 40}),
}
SLOTS = 2
ROUNDS = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Model, adapters, a prompt per (round, adapter or base) and the reference's tokens."""
    root = tmp_path_factory.mktemp("evict")
    model_dir = make_model(
        root / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    gen = torch.Generator().manual_seed(1)
    names = [*ADAPTERS, None]
    prompts = {
        (r, name): torch.randint(
            2, 250, (int(torch.randint(5, 120, (1,), generator=gen)),), generator=gen
        ).tolist()
        for r in range(ROUNDS)
        for name in names
    }
    want = {}
    with full_float32():
        for name in names:
            model = hf_model(model_dir, adapters.get(name), torch.float32)
            for r in range(ROUNDS):
                want[r, name] = reference_greedy(model, prompts[r, name], MAX_TOKENS)
            del model
    return SimpleNamespace(model_dir=model_dir, adapters=adapters, prompts=prompts, want=want)


@pytest.mark.parametrize("host_cache", [64, 2], ids=["host-holds-all", "host-smaller"])
@pytest.mark.parametrize("mode", ["blocking", "overlap", "prefetch"])
def test_evicted_adapters_reload_and_match_peft(served, mode, host_cache):
    with full_float32():
        engine = Engine(
            EngineConfig(
                model=str(served.model_dir),
                device="cuda",
                dtype="float32",
                num_kv_blocks=256,
                max_num_seqs=8,
                max_num_batched_tokens=64,
                max_loras_per_batch=SLOTS,
                max_lora_rank=64,
                max_loaded_loras=host_cache,
                adapter_loading=mode,
                adapters=tuple((name, str(path)) for name, path in served.adapters.items()),
            )
        )
        loads = []  # adapter names in the order their copies into a slot were enqueued
        upload = engine.adapters.uploader.upload

        def spy(slot, weights):
            loads.append(weights.name)
            upload(slot, weights)

        engine.adapters.uploader.upload = spy
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        got = {}
        for r in range(ROUNDS):
            names = [*ADAPTERS, None]
            if r == ROUNDS - 1:  # the adapters loaded once so far: round 2 evicted them
                once = {name for name, n in Counter(loads).items() if n == 1}
                assert not once & set(engine.adapters.slots.resident), loads
                names = [name for name in names if name in once or name is None]
            batch = [
                Request(f"{r}:{name}", served.prompts[r, name], params, name) for name in names
            ]
            for rid, (tokens, _) in run_to_completion(engine, batch).items():
                got[rid] = tokens
        torch.cuda.synchronize()

    want = {f"{r}:{name}": served.want[r, name] for r, name in served.want if f"{r}:{name}" in got}
    assert got == want, {rid: (got[rid], want[rid]) for rid in want if got[rid] != want[rid]}
    # Every adapter was loaded at least twice, used in between (round 1) and after (its last
    # round runs after its last load).
    counts = Counter(loads)
    assert set(counts) == set(ADAPTERS) and min(counts.values()) >= 2, loads
    stats = engine.adapters.stats
    assert stats.gpu_loads == len(loads) > len(ADAPTERS)
    if host_cache >= len(ADAPTERS):
        assert stats.disk_reads == len(ADAPTERS)  # read once, reloaded from host memory
    else:
        assert stats.disk_reads > len(ADAPTERS)  # evicted from host memory too: read again
