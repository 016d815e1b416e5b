"""The adapter-affinity router against Ray Serve's default, on a local Serve instance (CPU,
two ingress replicas each routing on its own, three engine replicas of two GPU slots each, nine
adapters): the same skewed workload through HTTP under `router: pow2` and `router: affinity`.
Both must answer exactly what transformers + PEFT answer; affinity must find adapters already in
a GPU slot more often (move fewer adapters into slots) and read fewer from disk."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.factories import hf_greedy, make_adapter, make_model

pytestmark = pytest.mark.serve

APP = "router-e2e"
PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9]]
NUM_ADAPTERS = 9
NUM_WAVES = 12
BURSTS_PER_WAVE = 3  # distinct adapters in a wave
BURST = 4  # requests for one adapter arriving together
NUM_REQUESTS = NUM_WAVES * BURSTS_PER_WAVE * BURST
MAX_TOKENS = 4
TARGETS = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["k_proj", "gate_proj", "up_proj"]]


def _workload() -> list[list[tuple[str, list[int]]]]:
    """Waves of concurrent requests: in each, a burst of `BURST` requests for each of a few
    adapters drawn with Zipf-like popularity, as when several users of one adapter are active
    at once. A wave starts when the previous one has finished."""
    rng = random.Random(7)
    names = [f"lora{i}" for i in range(NUM_ADAPTERS)]
    weights = [1.0 / (i + 1) for i in range(NUM_ADAPTERS)]
    waves = []
    for _ in range(NUM_WAVES):
        chosen: list[str] = []
        while len(chosen) < BURSTS_PER_WAVE:
            name = rng.choices(names, weights)[0]
            if name not in chosen:
                chosen.append(name)
        wave = [(name, rng.choice(PROMPTS)) for name in chosen for _ in range(BURST)]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


@pytest.fixture(scope="module")
def cluster(serve_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("router-e2e")
    model = make_model(root / "model")
    adapters = {
        f"lora{i}": make_adapter(
            model,
            root / f"lora{i}",
            rank=2 + 2 * (i % 3),
            target_modules=TARGETS[i % 3],
            seed=10 + i,
        )
        for i in range(NUM_ADAPTERS)
    }
    return {"url": serve_cluster["url"], "model": model, "adapters": adapters}


def _deploy(cluster, router: str) -> None:
    from ray import serve

    from app.main import build_app

    app = build_app(
        {
            "model": str(cluster["model"]),
            "served_model_name": "tiny",
            "adapters": {name: str(path) for name, path in cluster["adapters"].items()},
            "device": "cpu",
            "num_replicas": 3,
            # Two ingress replicas, each with its own router instance: they must agree on where
            # an adapter lives (rendezvous hashing, shared residency) rather than thrash.
            "num_ingress_replicas": 2,
            "max_loras_per_batch": 2,
            "max_loaded_loras": 4,
            "max_lora_rank": 8,
            "max_model_len": 64,
            "router": router,
        }
    )
    serve.run(app, name=APP, route_prefix="/")


async def _run_workload(url: str) -> list[tuple[str, list[int], str]]:
    async def one(client, adapter, prompt):
        r = await client.post(
            "/v1/completions",
            json={
                "model": adapter,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        return adapter, prompt, r.json()["choices"][0]["text"]

    results = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        # One request first, so every replica is up and the ingress knows the engine.
        await one(client, "tiny", PROMPTS[0])
        for wave in _workload():
            results += await asyncio.gather(*(one(client, a, p) for a, p in wave))
    return results


def _fleet_stats() -> list[dict]:
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    return handle.broadcast("stats").results(timeout_s=60)


def _measure(cluster, router: str) -> dict:
    from ray import serve

    _deploy(cluster, router)
    try:
        results = asyncio.run(_run_workload(cluster["url"]))
        stats = _fleet_stats()
    finally:
        serve.delete(APP)
    hits = sum(s["adapter_hits"] for s in stats)
    misses = sum(s["adapter_misses"] for s in stats)
    gpu_loads = sum(s["adapter_gpu_loads"] for s in stats)
    return {
        "results": results,
        "num_replicas": len(stats),
        "gpu_loads": gpu_loads,
        # Requests served without moving an adapter into a slot (the simulator's GPU-slot hit
        # rate). The engine's own hit rate counts prefetched loads as hits, so it hides them.
        "slot_hit_rate": 1 - gpu_loads / max(1, hits + misses),
        "disk_reads": sum(s["adapter_disk_reads"] for s in stats),
        "hit_rate": hits / max(1, hits + misses),
        "admissions": hits + misses,
    }


def test_affinity_hits_slots_more_often_than_pow2_and_both_match_peft(cluster):
    from transformers import AutoTokenizer

    pow2 = _measure(cluster, "pow2")
    affinity = _measure(cluster, "affinity")

    tok = AutoTokenizer.from_pretrained(cluster["model"])
    expected: dict[tuple[str, int], str] = {}
    for run in (pow2, affinity):
        assert run["num_replicas"] == 3
        assert run["admissions"] == NUM_REQUESTS  # the base-model warm-up needs no slot
        for adapter, prompt, text in run["results"]:
            key = (adapter, PROMPTS.index(prompt))
            if key not in expected:
                ids = hf_greedy(cluster["model"], prompt, MAX_TOKENS, cluster["adapters"][adapter])
                expected[key] = tok.decode(ids, skip_special_tokens=True)
            assert text == expected[key], (adapter, prompt)

    # Six GPU slots for nine adapters. Serve's router sends a burst for an adapter that no
    # replica reports yet to random replicas, each loading it; affinity keeps the burst on one.
    summary = {
        name: {key: run[key] for key in ("gpu_loads", "disk_reads", "slot_hit_rate", "hit_rate")}
        for name, run in (("pow2", pow2), ("affinity", affinity))
    }
    assert affinity["slot_hit_rate"] > pow2["slot_hit_rate"], summary
    assert affinity["disk_reads"] < pow2["disk_reads"], summary
