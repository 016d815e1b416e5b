"""Routers compared in the fleet simulator (sim/): the engine's own scheduler, slot pool and
prefetcher per replica, Ray Serve's default router (power of two choices with multiplexing, as
Ray 2.60 implements it) and ours (the real AffinityRouting, with and without prefetch hints).

    python -m benchmarks.bench_router_sim                 # both sets, 3 seeds: about 20 min
    python -m benchmarks.bench_router_sim --quick         # half the requests, 1 seed: 4 min
    python -m benchmarks.bench_router_sim --calibration benchmarks/results/sim_calibration.json

Sets: `serve`, the cells of benchmarks/bench_router_serve.py's GPU run (2 replicas, 64 rank-16
adapters, 8 slots, Poisson 6 req/s, the very requests it sends; popularity skewed and uniform),
so a row here is a prediction for a row there (`python -m sim.validate` checks them); `fleet`,
larger fleets on generated streams at 70% of the replicas' capacity. Each row is the mean over
simulator seeds; `loads_vs_pow2` divides by pow2's loads on the same cell. Costs come from the
calibration file (`python -m sim.calibrate` on a GPU), else the built-in H100 estimate.
Writes benchmarks/results/router_sim.{md,json}. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import write_results
from sim.calibration import DEFAULT, Calibration
from sim.fleet import ROUTERS, FleetConfig, simulate
from sim.replica import ReplicaConfig, capacity_rps
from sim.validate import DEFAULT_CALIBRATION
from sim.workload import Generated, Workload, serving_benchmark

RESULTS = Path(__file__).parent / "results"
FIGURES = (
    "loads_per_1k", "disk_reads_per_1k", "hit_rate", "imbalance", "ttft_p50_ms", "ttft_p99_ms",
    "adapter_wait_mean_ms",
)  # fmt: skip
COLUMNS = [
    "set", "workload", "replicas", "adapters", "router", "requests", "seeds", *FIGURES,
    "loads_vs_pow2",
]  # fmt: skip


@dataclass(frozen=True)
class Cell:
    set: str
    replicas: int
    adapters: int
    replica: ReplicaConfig
    workload: Workload


def cells(quick: bool, cal: Calibration) -> list[Cell]:
    out = []
    serve = ReplicaConfig(max_loras_per_batch=8, max_loaded_loras=64, max_model_len=2048)
    for popularity in ("skewed", "uniform"):
        w = serving_benchmark(
            num_adapters=64, slots=8, replicas=2, rate=6.0, num_requests=300,
            popularity=popularity,
        )  # fmt: skip
        out.append(Cell("serve", 2, 64, serve, w))
    fleet = ReplicaConfig(max_loras_per_batch=8, max_loaded_loras=64, max_num_seqs=64)
    prompt, output = (128, 512), (32, 96)
    per_replica = capacity_rps(cal, fleet, sum(prompt) / 2, sum(output) / 2)
    scale = 0.25 if quick else 0.5
    for replicas, adapters, kind, alpha in (
        (8, 256, "zipf", 1.0),
        (8, 256, "bursty", 1.0),
        (8, 256, "uniform", 1.0),
        (16, 1000, "zipf", 1.0),
    ):
        w = Generated(
            kind, alpha, num_adapters=adapters, num_requests=int(replicas * 1000 * scale),
            rate=0.7 * replicas * per_replica, prompt=prompt, output=output,
        ).build()  # fmt: skip
        out.append(Cell("fleet", replicas, adapters, fleet, w))
    return out


def run_one(job: tuple[Cell, str, int, Calibration]) -> dict:
    cell, router, seed, cal = job
    config = FleetConfig(num_replicas=cell.replicas, router=router, replica=cell.replica, seed=seed)
    return simulate(config, cell.workload, cal).as_dict()


def summarize(cell: Cell, router: str, runs: list[dict]) -> dict:
    row = {
        "set": cell.set,
        "workload": cell.workload.name,
        "replicas": cell.replicas,
        "adapters": cell.adapters,
        "router": router,
        "requests": runs[0]["sent"],
        "seeds": len(runs),
    }
    for name in FIGURES:
        row[name] = statistics.fmean(r[name] for r in runs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the requests, 1 seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    path = args.calibration or (DEFAULT_CALIBRATION if DEFAULT_CALIBRATION.exists() else None)
    cal = Calibration.load(path) if path else DEFAULT
    seeds = 1 if args.quick else args.seeds
    start = time.perf_counter()
    grid = cells(args.quick, cal)
    jobs = [(c, r, s, cal) for c in grid for r in ROUTERS for s in range(seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, jobs))
    rows = []
    for i, cell in enumerate(grid):
        by_router = {}
        for j, router in enumerate(ROUTERS):
            k = (i * len(ROUTERS) + j) * seeds
            by_router[router] = summarize(cell, router, results[k : k + seeds])
        base = by_router["pow2"]["loads_per_1k"]
        for row in by_router.values():
            row["loads_vs_pow2"] = row["loads_per_1k"] / base if base else None
            rows.append(row)
    path_md = write_results(
        args.out,
        "router_sim",
        "Routers in the fleet simulator",
        comparison=(
            "affinity (ours, with and without prefetch hints) vs pow2 (Ray Serve's default "
            "router with multiplexing, as Ray 2.60 implements it); loads_vs_pow2 = loads per "
            "1k requests over pow2's on the same cell. `serve` rows predict "
            "benchmarks/bench_router_serve.py's GPU run (python -m sim.validate)"
        ),
        columns=COLUMNS,
        rows=rows,
        extra={
            "device": "CPU simulation",
            "calibration": str(path) if path else f"built-in estimate {DEFAULT.source}",
            "model": (
                "replicas: the engine's Scheduler, SlotPool, HostCache, PrefetchQueue, "
                "CopyBudget, ReadTurns on a virtual clock; routers: Ray Serve 2.60's rules "
                "(sim/serve.py), one caller handle, max_ongoing_requests 256, residency pushed "
                "every 0.1 s, stats polled every 0.5 s, control loop 0.1 s; fleet rows: 8 slots, "
                "64 in host memory, 64 seqs, prompts 128-512, outputs 32-96, 70% of capacity, "
                "first 20% not measured"
            ),
            "imbalance": "max / mean of measured adapter requests finished per replica",
            "wall_s": round(time.perf_counter() - start, 1),
        },
    )
    print(path_md.read_text())


if __name__ == "__main__":
    main()
