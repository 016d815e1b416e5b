"""Routing policies compared in the discrete-event simulator (router/simulator.py): adapter loads,
GPU-slot hit rate, load imbalance and simulated TTFT, for our affinity policy against Ray Serve's
default (power of two choices with multiplexing), round robin and a consistent-hash ring.

    python -m benchmarks.bench_router_sim            # all of it: about 10 min, --workers 1
    python -m benchmarks.bench_router_sim --quick    # fewer requests and seeds, for a smoke run
    python -m benchmarks.bench_router_sim --hints    # router-fed prefetch hints, about 3 min

Writes benchmarks/results/router_sim.{md,json}: the headline, a sensitivity run and the grid in one
table, then small fleets (2 and 4 replicas, 64 adapters, light load, several seeds) in a section
of their own; or with `--hints` router_hints.{md,json}: affinity with prefetch hints against
affinity and pow2 without, with a dispatch delay and requests held in the caller at
`max_ongoing_requests`. CPU only: no GPU is involved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
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
    return {
        "set": tag,
        "seed": config.seed,
        "load_fraction": config.load_fraction,
        **result.as_dict(),
    }


def run_hinted(job: tuple[str, str, SimConfig]) -> dict:
    tag, label, config = job
    policy, hints = HINT_VARIANTS[label]
    config = replace(config, **hints)
    result = simulate(config, lambda i: make_policy(policy, i), label)
    return {
        "set": tag,
        "seed": config.seed,
        "load_fraction": config.load_fraction,
        "max_ongoing_requests": config.max_ongoing_requests,
        **result.as_dict(),
    }


def run_all(fn: Callable[[tuple[str, str, SimConfig]], dict], work: list, workers: int) -> list:
    # Longest first, so the pool does not end on one slow run.
    order = sorted(
        range(len(work)), key=lambda i: -work[i][2].num_requests * work[i][2].num_replicas
    )
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(fn, [work[i] for i in order]))
    done = dict(zip(order, results, strict=True))
    return [done[i] for i in range(len(work))]


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


# -- small fleets ------------------------------------------------------------------------------

# The regime of a run on 2 GPUs (results/router_serve_2x_64a_r16_s8_skewed.md): 2 replicas, 64
# adapters over 8 slots each, about 2 requests in flight per replica (10% of nominal capacity
# here), outputs of 32-96 tokens. With so few replicas, where the hottest adapters' hash homes
# fall decides the balance, and a few requests are a large share of a replica's load.
SMALL_POLICIES = ["affinity", "pow2"]
SMALL_WORKLOADS = {"skewed0.7": Workload("skewed", 0.7), "uniform": WORKLOADS["uniform"]}
SMALL_REPLICAS = (2, 4)
SMALL_LOADS = (0.1, 0.3, 0.5)
SMALL_COLUMNS = [
    "num_replicas",
    "workload",
    "load_fraction",
    "policy",
    "seeds",
    "hit_rate",
    "loads_per_1k",
    "loads_vs_pow2",
    "imbalance_requests",
    "imbalance_queue",
    "ttft_p50_s",
    "ttft_p99_s",
]
SMALL_MEANS = ["hit_rate", "loads_per_1k", "imbalance_requests", "imbalance_queue"]
SMALL_MEANS += ["ttft_p50_s", "ttft_p99_s"]


def small_seeds(quick: bool) -> range:
    # Loads per 1k requests are in the tens here, and where the hottest adapters' hash homes
    # fall changes with the seed: 8 seeds leave the affinity/pow2 ratio uncertain by about 5%.
    return range(3 if quick else 16)


def small_jobs(quick: bool) -> list[tuple[str, str, SimConfig]]:
    base = SimConfig(
        num_adapters=64,
        num_slots=8,
        host_capacity=64,
        output_tokens=(32, 96),
        num_requests=2000 if quick else 8000,
    )
    return [
        (
            "small",
            policy,
            replace(base, num_replicas=r, workload=w, load_fraction=load, seed=seed),
        )
        for r, w, load in itertools.product(SMALL_REPLICAS, SMALL_WORKLOADS.values(), SMALL_LOADS)
        for seed in small_seeds(quick)
        for policy in SMALL_POLICIES
    ]


def small_cells(rows: list[dict]) -> list[dict]:
    """Per (replicas, workload, load, policy): the mean over seeds of each metric, and
    loads_vs_pow2 = mean loads / pow2's mean loads in the same cell."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["num_replicas"], r["workload"], r["load_fraction"], r["policy"])
        groups.setdefault(key, []).append(r)
    cells = []
    for (replicas, workload, load, policy), group in groups.items():
        cell = {
            "num_replicas": replicas,
            "workload": workload,
            "load_fraction": load,
            "policy": policy,
            "seeds": len(group),
        }
        cell.update({k: statistics.fmean(r[k] for r in group) for k in SMALL_MEANS})
        cells.append(cell)
    pow2 = {
        (c["num_replicas"], c["workload"], c["load_fraction"]): c["loads_per_1k"]
        for c in cells
        if c["policy"] == "pow2"
    }
    for c in cells:
        base = pow2.get((c["num_replicas"], c["workload"], c["load_fraction"]))
        if base:
            c["loads_vs_pow2"] = c["loads_per_1k"] / base
    return cells


def small_summary(cells: list[dict]) -> dict:
    """Per workload, over every (replicas, load) cell: affinity's loads against pow2's (ratio of
    the sums) and the mean request imbalance of each."""
    out = {}
    for workload in dict.fromkeys(c["workload"] for c in cells):
        by = {
            p: [c for c in cells if c["workload"] == workload and c["policy"] == p]
            for p in SMALL_POLICIES
        }
        loads = {p: sum(c["loads_per_1k"] for c in by[p]) for p in by}
        imbalance = {p: statistics.fmean(c["imbalance_requests"] for c in by[p]) for p in by}
        out[workload] = {
            "loads_vs_pow2": round(loads["affinity"] / loads["pow2"], 3),
            "imbalance_requests_affinity": round(imbalance["affinity"], 3),
            "imbalance_requests_pow2": round(imbalance["pow2"], 3),
            "loads_at_most_pow2": loads["affinity"] <= loads["pow2"],
            "imbalance_at_most_pow2": imbalance["affinity"] <= imbalance["pow2"],
        }
    return out


def append_small_fleets(md: Path, rows: list[dict], quick: bool) -> None:
    """Add the small-fleet section to the markdown written by `write_results`, and its rows
    (per seed), cells (mean over seeds) and summary to the JSON beside it."""
    cells = small_cells(rows)
    summary = small_summary(cells)
    config = small_jobs(quick)[0][2]
    lines = [
        "",
        "## Small fleets",
        "",
        f"- model: 64 adapters, {config.num_slots} GPU slots and {config.host_capacity} host "
        f"entries per replica, outputs {config.output_tokens[0]}-{config.output_tokens[1]} tokens,"
        f" {config.num_requests} requests per run (first {config.warmup_fraction:.0%} not "
        f"measured), {len(small_seeds(quick))} seeds per cell; skewed0.7 = geometric popularity, "
        "adapter i weighs 0.7^i (benchmarks/loadgen/popularity.py's skewed); load_fraction 0.1 is "
        "about 2 requests in flight per replica, as in router_serve_2x_64a_r16_s8_skewed.md",
        "- goal: affinity makes no more adapter loads than pow2 and balances requests over "
        "replicas at least as well (imbalance_requests = max/mean of requests per replica)",
        f"- summary (over the 6 cells of each workload): {summary}",
        "- each row: mean over seeds; loads_vs_pow2 = loads / pow2's loads in the same cell",
        "",
        "| " + " | ".join(SMALL_COLUMNS) + " |",
        "|" + " --- |" * len(SMALL_COLUMNS),
    ]
    lines += ["| " + " | ".join(_cell(c.get(k)) for k in SMALL_COLUMNS) + " |" for c in cells]
    with md.open("a") as f:
        f.write("\n".join(lines) + "\n")
    path = md.with_suffix(".json")
    data = json.loads(path.read_text())
    data["small_fleet"] = {"summary": summary, "cells": cells, "rows": rows}
    path.write_text(json.dumps(data, indent=2) + "\n")


def _cell(v: object) -> str:
    # As benchmarks/common.py writes its tables: 3 significant digits below 100.
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


# -- router-fed prefetch hints ------------------------------------------------------------------

# label -> (policy, SimConfig fields). "affinity+hints" is the router as written
# (router/serve_router.py: a hint only where the replica's stats show a free GPU slot);
# "affinity+hints-any-slot" hints every routed adapter the view does not show on the GPU or
# loading, leaving the choice to the replica's prefetch rule.
HINT_VARIANTS: dict[str, tuple[str, dict]] = {
    "pow2": ("pow2", {}),
    "affinity": ("affinity", {}),
    "affinity+hints": ("affinity", {"prefetch_hints": True, "hint_free_slots_only": True}),
    "affinity+hints-any-slot": (
        "affinity",
        {"prefetch_hints": True, "hint_free_slots_only": False},
    ),
}
HINT_SEEDS = (0, 1)
HINT_COLUMNS = [
    "set",
    "seed",
    "policy",
    "hit_rate",
    "loads_per_1k",
    "disk_reads_per_1k",
    "adapter_wait_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_mean_s",
    "held_fraction",
    "caller_wait_mean_s",
    "hints_per_1k",
    "hints_misdirected_per_1k",
    "hint_loads_per_1k",
    "hint_loads_wasted_per_1k",
]


def hint_jobs(quick: bool) -> list[tuple[str, str, SimConfig]]:
    base = SimConfig(
        num_replicas=64,
        num_adapters=1000,
        num_requests=6000 if quick else 30_000,
        dispatch_s=0.003,
        hold_at_caller=True,
        hint_latency_s=0.001,
    )
    scenarios = {
        "zipf1@70%": replace(base, workload=WORKLOADS["zipf1"], load_fraction=0.7),
        "zipf1@90%": replace(base, workload=WORKLOADS["zipf1"], load_fraction=0.9),
        # max_ongoing_requests = max_num_seqs: what the batch cannot take waits in the caller.
        "zipf1@90%,ongoing64": replace(
            base, workload=WORKLOADS["zipf1"], load_fraction=0.9, max_ongoing_requests=64
        ),
        "bursty@70%": replace(base, workload=WORKLOADS["bursty"], load_fraction=0.7),
        "bursty@90%": replace(base, workload=WORKLOADS["bursty"], load_fraction=0.9),
        "bursty@90%,ongoing64": replace(
            base, workload=WORKLOADS["bursty"], load_fraction=0.9, max_ongoing_requests=64
        ),
        "uniform10k@70%": replace(
            base, workload=WORKLOADS["uniform"], num_adapters=10_000, load_fraction=0.7
        ),
    }
    return [
        (tag, label, replace(config, seed=seed))
        for tag, config in scenarios.items()
        for seed in HINT_SEEDS
        for label in HINT_VARIANTS
    ]


RATIO_KEYS = {"P50": "ttft_p50_s", "P99": "ttft_p99_s", "wait": "adapter_wait_mean_s"}


def hint_summary(rows: list[dict]) -> dict[str, dict[str, str]]:
    """Per scenario and hint variant: hinted / affinity without hints for TTFT P50, P99 and
    adapter wait, one figure per seed ("0.96/0.93" = seed 0 / seed 1)."""
    by = {(r["set"], r["seed"], r["policy"]): r for r in rows}
    out: dict[str, dict[str, str]] = {}
    for tag in dict.fromkeys(r["set"] for r in rows):
        for label in ("affinity+hints", "affinity+hints-any-slot"):
            parts = []
            for name, key in RATIO_KEYS.items():
                ratios = []
                for seed in HINT_SEEDS:
                    plain, hinted = by[tag, seed, "affinity"][key], by[tag, seed, label][key]
                    ratios.append(f"{hinted / plain:.2f}" if plain else "n/a")
                parts.append(f"{name} {'/'.join(ratios)}")
            out.setdefault(tag, {})[label] = ", ".join(parts)
    return out


def write_hints(rows: list[dict], out: str, quick: bool, wall: float) -> Path:
    base = hint_jobs(quick)[0][2]
    return write_results(
        out,
        "router_hints",
        "Router-fed prefetch hints in the fleet simulator",
        comparison=(
            "affinity with prefetch hints (as router/serve_router.py sends them: only to a "
            "replica showing a free slot; and to any replica, the prefetch rule deciding) vs "
            "affinity and pow2 without hints. ratios = hinted / affinity without hints, same "
            "scenario and seed (TTFT P50, P99, adapter wait); seeds 0 and 1 show how much "
            "of a difference is noise"
        ),
        columns=HINT_COLUMNS,
        rows=rows,
        extra={
            "device": "CPU simulation",
            "ratios (hinted / affinity, seed 0/seed 1)": hint_summary(rows),
            "model": (
                f"64 replicas, {base.num_slots} GPU slots, {base.host_capacity} host, "
                f"{base.max_num_seqs} seqs, max_ongoing_requests {base.max_ongoing_requests} "
                f"(ongoing64: 64) with requests beyond it held in the caller, dispatch "
                f"{base.dispatch_s * 1e3:g} ms, hint latency {base.hint_latency_s * 1e3:g} ms, "
                f"one hint per (adapter, replica) per router each {base.hint_interval_s:g} s, "
                f"host→GPU {base.host_to_gpu_s * 1e3:g} ms, disk→host "
                f"{base.disk_to_host_s * 1e3:g} ms, {base.num_requests} requests per run, first "
                f"{base.warmup_fraction:.0%} not measured"
            ),
            "adapter_wait": "from reaching the replica until the adapter's slot was ready, mean"
            " over all requests (0 when it was ready)",
            "hit_rate": "request found its adapter in a GPU slot (ready or loading) on reaching"
            " the replica",
            "sets": "N adapters (1,000 unless uniform10k), workload @ load as a share of "
            "capacity; held_fraction = share of requests held in the caller",
            "wall_s": round(wall, 1),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--hints", action="store_true", help="only the prefetch-hint comparison")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    start = time.perf_counter()
    if args.hints:
        rows = run_all(run_hinted, hint_jobs(args.quick), args.workers)
        path = write_hints(rows, args.out, args.quick, time.perf_counter() - start)
        print(path.read_text())
        return
    everything = run_all(run_one, jobs(args.quick) + small_jobs(args.quick), args.workers)
    rows = [r for r in everything if r["set"] != "small"]
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
    append_small_fleets(path, [r for r in everything if r["set"] == "small"], args.quick)
    print(path.read_text())


if __name__ == "__main__":
    main()
