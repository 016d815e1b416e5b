"""Routing policies compared in the discrete-event simulator (router/simulator.py): adapter loads,
GPU-slot hit rate, load imbalance and simulated TTFT, for our affinity policy against Ray Serve's
default (power of two choices with multiplexing), round robin and a consistent-hash ring.

    python -m benchmarks.bench_router_sim            # headline + grid, about 5 min on 2 cores
    python -m benchmarks.bench_router_sim --quick    # fewer requests, for a smoke run

Writes benchmarks/results/router_sim.{md,json}. CPU only: no GPU is involved.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from benchmarks.common import write_results
from router.policy import (
    AffinityPolicy,
    ConsistentHashPolicy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
)
from router.simulator import SimConfig, SimResult, Workload, simulate

RESULTS = Path(__file__).parent / "results"


def make_policy(name: str, router_index: int) -> RoutingPolicy:
    # A registry keyed by name would need picklable factories for the worker processes; the
    # four names are fixed, so a dict of constructors does it.
    return {
        "affinity": lambda: AffinityPolicy(),
        "pow2": lambda: PowerOfTwoPolicy(seed=router_index),
        "round_robin": lambda: RoundRobinPolicy(),
        "consistent_hash": lambda: ConsistentHashPolicy(),
    }[name]()


POLICIES = ["affinity", "pow2", "round_robin", "consistent_hash"]
WORKLOADS = {
    "uniform": Workload("uniform"),
    "zipf0.8": Workload("zipf", 0.8),
    "zipf1": Workload("zipf", 1.0),
    "zipf1.2": Workload("zipf", 1.2),
    "bursty": Workload("bursty", 1.0),
}


def run_one(job: tuple[str, str, SimConfig]) -> dict:
    tag, policy, config = job
    result: SimResult = simulate(config, lambda i: make_policy(policy, i), policy)
    return {"set": tag, **result.as_dict()}


def jobs(quick: bool) -> list[tuple[str, str, SimConfig]]:
    scale = 0.2 if quick else 1.0
    out: list[tuple[str, str, SimConfig]] = []
    # Headline: long enough for caches to reach steady state after the 20% warm-up.
    headline = SimConfig(
        num_replicas=64,
        num_adapters=1000,
        num_requests=int(100_000 * scale),
        workload=WORKLOADS["zipf1"],
    )
    out += [("headline", p, headline) for p in POLICIES]
    # Sensitivity: twice the GPU slots per replica.
    out += [("slots16", p, replace(headline, num_slots=16)) for p in POLICIES]
    # Grid: fewer requests per run; per-request cost grows with the number of replicas.
    for adapters, replicas, workload in itertools.product(
        (1000, 10_000), (8, 64, 256), ("uniform", "zipf0.8", "zipf1.2", "bursty")
    ):
        n = {8: 10_000, 64: 20_000, 256: 30_000}[replicas]
        config = SimConfig(
            num_replicas=replicas,
            num_adapters=adapters,
            num_requests=int(n * scale),
            workload=WORKLOADS[workload],
        )
        out += [("grid", p, config) for p in POLICIES]
    return out


COLUMNS = [
    "set",
    "num_adapters",
    "num_replicas",
    "workload",
    "policy",
    "num_requests",
    "hit_rate",
    "loads_per_1k",
    "disk_reads_per_1k",
    "imbalance_queue",
    "imbalance_requests",
    "ttft_p50_s",
    "ttft_p99_s",
]


def headline_summary(rows: list[dict]) -> dict:
    by = {r["policy"]: r for r in rows if r["set"] == "headline"}
    ours, pow2 = by["affinity"], by["pow2"]
    others = [r for p, r in by.items() if p != "affinity"]
    return {
        "loads_vs_pow2": round(ours["loads_per_1k"] / pow2["loads_per_1k"], 3),
        "loads_at_most_half_of_pow2": ours["loads_per_1k"] <= 0.5 * pow2["loads_per_1k"],
        "imbalance_queue": round(ours["imbalance_queue"], 3),
        "imbalance_at_most_1.25": ours["imbalance_queue"] <= 1.25,
        "ttft_p99_s": round(ours["ttft_p99_s"], 3),
        "best_other_ttft_p99_s": round(min(r["ttft_p99_s"] for r in others), 3),
        "ttft_p99_best": all(ours["ttft_p99_s"] < r["ttft_p99_s"] for r in others),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    work = jobs(args.quick)
    start = time.perf_counter()
    # Longest first, so the pool does not end on one slow run.
    order = sorted(
        range(len(work)), key=lambda i: -work[i][2].num_requests * work[i][2].num_replicas
    )
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, [work[i] for i in order]))
    done = dict(zip(order, results, strict=True))
    rows = [done[i] for i in range(len(work))]
    wall = time.perf_counter() - start
    defaults = SimConfig()
    summary = headline_summary(rows)
    path = write_results(
        args.out,
        "router_sim",
        "Routing policies in the fleet simulator",
        comparison=(
            "affinity (ours) vs pow2 (Ray Serve's default router with multiplexing), round "
            "robin and a consistent-hash ring. Goal at 1,000 adapters, 64 replicas, Zipf 1.0: "
            "at most half of pow2's adapter loads, imbalance at most 1.25, best TTFT P99"
        ),
        columns=COLUMNS,
        rows=rows,
        extra={
            "device": "CPU simulation",
            "headline": summary,
            "imbalance": "max/mean over replicas of time-averaged queue length (imbalance_queue);"
            " imbalance_requests = max/mean of requests routed per replica",
            "hit_rate": "request found its adapter in a GPU slot (ready or loading) on arrival",
            "model": (
                f"{defaults.num_slots} GPU slots, {defaults.host_capacity} host, "
                f"{defaults.max_num_seqs} seqs, step {defaults.step_base_s * 1e3:g} ms + "
                f"{defaults.step_per_seq_s * 1e3:g} ms/seq, prefill "
                f"{defaults.prefill_per_token_s * 1e6:g} µs/token, load host→GPU "
                f"{defaults.host_to_gpu_s * 1e3:g} ms, disk→host {defaults.disk_to_host_s * 1e3:g}"
                f" ms, load {defaults.load_fraction:.0%} of capacity, "
                f"{defaults.num_routers} routers, stats every {defaults.stats_period_s:g} s, "
                f"first {defaults.warmup_fraction:.0%} of requests not measured"
            ),
            "wall_s": round(wall, 1),
        },
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
