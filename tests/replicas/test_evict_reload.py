"""Adapters evicted and loaded again, on CPU against transformers + PEFT: more adapters than GPU
slots (and, in one variant, than the host cache holds), every adapter used before and after its
eviction, in every loading mode. A reload must give the adapter's own outputs, whatever the slot
held before (a larger rank, other targets)."""

import pytest

from replicas.adapters.modes import LOADING_MODES
from replicas.request import Request
from tests.factories import LORA_MODULES
from tests.replicas.conftest import (
    greedy,
    make_engine,
    peft_greedy_table,
    run_to_completion,
    write_adapters,
)

PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9]]
MAX_TOKENS = 6
NUM_SLOTS = 2
# Used in this order, two slots take turns: each adapter lands in a slot that last held an
# adapter of another rank and other targets, so rows a reload leaves stale would change outputs.
SPECS = {
    "all-r8": dict(
        rank=8,
        lora_alpha=16,
        target_modules=LORA_MODULES,
    ),
    "mlp-r6": dict(rank=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qv-r2": dict(rank=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "kou-r4": dict(
        rank=4, lora_alpha=4, target_modules=["k_proj", "o_proj", "up_proj"], use_rslora=True
    ),
}


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    return write_adapters(models["llama"], tmp_path_factory.mktemp("evict"), SPECS, 20)


@pytest.fixture(scope="module")
def expected(models, adapters):
    """(adapter or None, prompt index) -> PEFT's greedy tokens."""
    return peft_greedy_table(models["llama"], adapters, PROMPTS, MAX_TOKENS)


def run_and_check(engine, work: list[tuple[str | None, int]], expected, tag: str) -> None:
    """Run requests (adapter, prompt index) together to completion; each equals PEFT's."""
    requests = [
        Request(f"{tag}-{k}", PROMPTS[p], greedy(MAX_TOKENS), name)
        for k, (name, p) in enumerate(work)
    ]
    results = run_to_completion(engine, requests)
    for r, key in zip(requests, work, strict=True):
        assert results[r.request_id][0] == expected[key], (tag, key)


@pytest.mark.parametrize("host_capacity", [8, NUM_SLOTS], ids=["host-holds-all", "host-small"])
@pytest.mark.parametrize("mode", sorted(LOADING_MODES))
def test_every_adapter_reloaded_after_eviction_matches_peft(
    models, adapters, expected, mode, host_capacity
):
    names = list(adapters)
    engine = make_engine(
        models["llama"],
        adapters=tuple((k, str(v)) for k, v in adapters.items()),
        max_loras_per_batch=NUM_SLOTS,
        max_loaded_loras=host_capacity,
        adapter_loading=mode,
    )
    # Everything at once: adapters churn through the slots while others hold theirs.
    run_and_check(engine, [(n, p) for p in range(2) for n in [None, *names]], expected, "mix")
    # Then each adapter alone (beside a base request), twice round in the same order. Under LRU
    # a cycle over more adapters than slots evicts each one before its next use, so the second
    # round reloads every adapter into a slot last held by another.
    for round_ in range(2):
        before = engine.stats()
        for i, name in enumerate(names):
            run_and_check(
                engine,
                [(name, round_), (name, 1 - round_), (None, i % 2)],
                expected,
                f"round{round_}-{name}",
            )
        after = engine.stats()
    assert after.adapter_gpu_loads - before.adapter_gpu_loads == len(names)
    reads = after.adapter_disk_reads - before.adapter_disk_reads
    # A host cache smaller than the cycle reads every adapter from disk again; one that holds
    # them all serves every reload from host memory.
    assert reads == (len(names) if host_capacity < len(names) else 0)
    assert after.adapter_gpu_loads > len(names)
    if host_capacity < len(names):
        assert after.adapter_disk_reads > len(names)
    assert engine.adapters.slots.num_held == 0
    assert after.num_free_kv_blocks == after.num_kv_blocks
