"""The routing cells run on GPUs, and what the simulator predicts for each.

    python -m sim.cells                       # every cell, every router, 3 seeds
    python -m sim.cells --cells placement-2x,easy-2x --seeds 1

A cell is one `benchmarks/bench_router_serve.py` run (`--cell NAME` runs it through HTTP):
fleet shape, adapters, popularity and Poisson rate. Three kinds:
- placement: many rank-64 adapters (a load costs about a decode step, a disk read fifty)
  over few slots and a host cache a quarter of the catalogue, Zipf 1.0: where a replica finds
  an adapter matters;
- easy: 64 rank-16 adapters, 8 slots, all in host memory, skewed: every router finds nearly
  every adapter resident, so routing can only cost balance;
- hot: one adapter half the traffic: it must be served by more than one replica.

The predictions use `benchmarks/results/sim_calibration.json` (H200, rank 16) scaled to the
cell's rank (`Calibration.for_rank`), the very requests the benchmark sends
(`sim.workload.serving_benchmark`) and what the served path adds, measured (`served_path`:
the cells run through HTTP). Beside them, `sim.bound`'s floors on a router's loads and disk
reads for the cell's requests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sim.bound import LoadBound, fleet_bound
from sim.calibration import DEFAULT, Calibration
from sim.fleet import ROUTERS, Fleet, FleetConfig
from sim.replica import ReplicaConfig, capacity_rps
from sim.serve import ServeConfig
from sim.workload import Workload, one_adapter_serving, serving_benchmark

RESULTS = Path(__file__).parents[1] / "benchmarks/results"
CALIBRATION = RESULTS / "sim_calibration.json"
# The same requests through HTTP and in-process to one engine on an H200 (bench_serve, seeds).
SERVED_PATH_RUN = RESULTS / "bench_serve_seeds_warmup.json"
FIGURES = (
    "loads_per_1k", "disk_reads_per_1k", "arrival_hit_rate", "hit_rate", "adapter_wait_mean_ms",
    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "throughput_tok_s", "imbalance", "hot_replicas",
    "hot_spread_s",
)  # fmt: skip
HOT = "lora-0"  # the most popular adapter of every cell (workloads.router_cell.adapter_names)


_WORKLOAD_OPTIONS = (
    "num_adapters", "slots", "replicas", "rate", "num_requests", "popularity", "input_len",
    "output_len", "seed",
)  # fmt: skip


@dataclass(frozen=True)
class RouterCell:
    """One bench_router_serve run; field names are its options'."""

    name: str
    replicas: int
    num_adapters: int
    rank: int
    slots: int
    host_cache: int
    rate: float
    num_requests: int
    popularity: str
    input_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (32, 96)
    max_num_seqs: int = 64
    max_model_len: int = 2048
    seed: int = 0
    # Caller handles, each with its own router: the app's ingress replicas (2 per engine
    # replica on GPUs, AppArgs.ingress_replicas). None: that default.
    num_routers: int | None = None

    @property
    def routers(self) -> int:
        return self.num_routers or 2 * self.replicas

    def workload(self) -> Workload:
        """The requests bench_router_serve sends for this cell (its options of those names)."""
        return serving_benchmark(**{name: getattr(self, name) for name in _WORKLOAD_OPTIONS})

    def replica_config(self) -> ReplicaConfig:
        return ReplicaConfig(
            max_loras_per_batch=self.slots,
            max_loaded_loras=max(self.host_cache, self.slots),
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    def popularity_weights(self) -> dict[str, float]:
        """Each adapter's probability a measured request (`workloads.popularity`, which the
        benchmark draws them from, each request on its own)."""
        from workloads.popularity import popularity_weights
        from workloads.router_cell import adapter_names

        weights = popularity_weights(self.popularity, self.num_adapters)
        return dict(zip(adapter_names(self.num_adapters), map(float, weights), strict=True))

    def bound(self) -> LoadBound:
        """`sim.bound.fleet_bound` for this cell's requests, slots, host caches and popularity."""
        w = self.workload()
        return fleet_bound(
            [a.adapter for a in w.measured],
            gpu_entries=self.replicas * self.slots,
            memory_entries=self.replicas * max(self.host_cache, self.slots),
            warmup=[a.adapter for a in w.warmup],
            popularity=self.popularity_weights(),
        )

    def capacity_share(self, cal: Calibration) -> float:
        """The rate over the fleet's nominal capacity (`capacity_rps`: full batches, every
        adapter resident)."""
        prompt, output = sum(self.input_len) / 2, sum(self.output_len) / 2
        per_replica = capacity_rps(cal.for_rank(self.rank), self.replica_config(), prompt, output)
        return self.rate / (self.replicas * per_replica)


def _cells() -> dict[str, RouterCell]:
    out = {}
    for n in (2, 4):
        out[f"placement-{n}x"] = RouterCell(
            f"placement-{n}x", replicas=n, num_adapters=256, rank=64, slots=16, host_cache=64,
            rate=8.0 * n, num_requests=400 * n, popularity="zipf",
        )  # fmt: skip
        out[f"easy-{n}x"] = RouterCell(
            f"easy-{n}x", replicas=n, num_adapters=64, rank=16, slots=8, host_cache=64,
            rate=3.0 * n, num_requests=150 * n, popularity="skewed",
        )  # fmt: skip
        out[f"hot-{n}x"] = RouterCell(
            f"hot-{n}x", replicas=n, num_adapters=64, rank=16, slots=8, host_cache=64,
            rate=6.0 * n, num_requests=240 * n, popularity="hot",
        )  # fmt: skip
    return out


CELLS = _cells()


def calibration(path: str | Path | None = None) -> Calibration:
    """The calibration file at `path`, else the recorded H200 one, else the built-in estimate."""
    path = path or (CALIBRATION if CALIBRATION.exists() else None)
    return Calibration.load(path) if path else DEFAULT


@dataclass(frozen=True)
class ServedPath:
    """What serving through HTTP adds to the engine's own times (`FleetConfig`'s `overhead_s`
    and `served_step_s`)."""

    overhead_s: float  # HTTP, Serve's proxy and the ingress: client <-> router, both ways
    step_s: float  # added to every engine step under Serve


IN_PROCESS = ServedPath(0.0, 0.0)


def served_path(
    run: str | Path = SERVED_PATH_RUN,
    cal: Calibration | None = None,
    rpc_s: float = ServeConfig.rpc_s,
) -> ServedPath:
    """The served path from a one-adapter `benchmarks/bench_serve.py` run that sent the same
    requests through HTTP and to the same engine in-process, one GPU:

    - `step_s`: the difference of their ITL P50s. A Serve replica's step thread shares its
      process, and its GIL, with the replica's event loop and Ray's threads; in-process it runs
      alone. The seeds run: 9.67 - 7.45 = 2.22 ms.
    - `overhead_s`: the difference of their TTFT P50s, less the router -> replica and replica
      -> router hops the fleet times itself (`rpc_s` each) and less what the slower steps add
      to a first token in that run: the simulator replays its requests in-process with and
      without `step_s` (`cal`: the recorded calibration). The seeds run: 48.3 - 28.5 - 1.0 -
      4.0 = 14.8 ms."""
    data = json.loads(Path(run).read_text())
    rows = {row["path"]: row for row in data["rows"]}
    try:
        http, local = rows["http"], rows["in-process"]
        served_ttft_s = (http["ttft_p50_ms"] - local["ttft_p50_ms"]) / 1e3
        step_s = max(0.0, (http["itl_p50_ms"] - local["itl_p50_ms"]) / 1e3)
        w = data["workload"]
        workload = one_adapter_serving(
            num_requests=int(w["requests"]),
            input_len=_lengths(w["prompts"]),
            output_len=_lengths(w["outputs"]),
            rate=float(w["rate"]),
            max_num_seqs=int(w["max_num_seqs"]),
        )
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{run}: no HTTP and in-process TTFT and ITL P50 of the same one-adapter requests"
        ) from None
    cal = cal or calibration()
    replica = ReplicaConfig(
        max_loras_per_batch=1, max_loaded_loras=1, max_num_seqs=int(w["max_num_seqs"])
    )
    ttft = [
        Fleet(FleetConfig(num_replicas=1, replica=replica, served_step_s=extra), workload, cal)
        .run()
        .ttft_p50_ms
        / 1e3
        for extra in (0.0, step_s)
    ]
    return ServedPath(max(0.0, served_ttft_s - 2 * rpc_s - (ttft[1] - ttft[0])), step_s)


def _lengths(text: str) -> tuple[int, int]:
    low, _, high = str(text).partition(":")
    return int(low), int(high or low)


def predict(
    cell: RouterCell,
    cal: Calibration,
    routers: Sequence[str] = ROUTERS,
    *,
    seeds: int = 3,
    policy_kwargs: tuple[tuple[str, Any], ...] = (),
    served: ServedPath = IN_PROCESS,
) -> dict[str, dict[str, float]]:
    """Per router, each of FIGURES averaged over `seeds` simulator seeds (the workload is the
    cell's, the same for every seed). `served`: what HTTP and Serve add (`served_path()` for
    the cells, which run through HTTP)."""
    workload = cell.workload()
    cost = cal.for_rank(cell.rank)
    out: dict[str, dict[str, float]] = {}
    for router in routers:
        runs = []
        for seed in range(seeds):
            config = FleetConfig(
                num_replicas=cell.replicas,
                router=router,
                num_routers=cell.routers,
                replica=cell.replica_config(),
                policy_kwargs=policy_kwargs,
                overhead_s=served.overhead_s,
                served_step_s=served.step_s,
                seed=seed,
            )
            fleet = Fleet(config, workload, cost)
            runs.append({**fleet.run().as_dict(), **hot_adapter(fleet)})
        out[router] = {f: statistics.fmean(r[f] for r in runs) for f in FIGURES}
    return out


def hot_adapter(fleet: Fleet, adapter: str = HOT) -> dict[str, float]:
    """How the most popular adapter was served in the measured part of a finished run:
    `hot_replicas`, the replicas that served at least a tenth of its fair share (1/n) of its
    requests, and `hot_spread_s`, seconds from the first measured request to the first of its
    requests served by a replica other than the first one's (inf: never)."""
    mine = sorted(
        (r for r in fleet.requests if r.measured and r.adapter == adapter and not r.failed),
        key=lambda r: r.created_at,
    )
    if not mine:
        return {"hot_replicas": 0.0, "hot_spread_s": math.inf}
    counts = Counter(r.replica_id for r in mine)
    floor = 0.1 * len(mine) / fleet.config.num_replicas
    start = min(r.created_at for r in fleet.requests if r.measured)
    other = next((r for r in mine if r.replica_id != mine[0].replica_id), None)
    return {
        "hot_replicas": float(sum(n >= floor for n in counts.values())),
        "hot_spread_s": math.inf if other is None else other.created_at - start,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help="comma-separated cell names")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--calibration", default=None)
    ap.add_argument(
        "--in-process",
        action="store_true",
        help=f"leave out what HTTP and Serve add (default: measured, {SERVED_PATH_RUN.name})",
    )
    ap.add_argument("--json", default=None, help="also write the predictions here")
    args = ap.parse_args(argv)
    cal = calibration(args.calibration)
    served = IN_PROCESS if args.in_process else served_path(cal=cal)
    print(
        f"Served path: HTTP, proxy and ingress {served.overhead_s * 1e3:.1f} ms on every TTFT, "
        f"{served.step_s * 1e3:.2f} ms more a step"
    )
    result: dict[str, Any] = {"served_path": asdict(served)}
    head = ["cell", "router", *FIGURES]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    bounds = {}
    for name in args.cells.split(","):
        cell = CELLS[name]
        figures = predict(cell, cal, seeds=args.seeds, served=served)
        bounds[name] = cell.bound()
        result[name] = {
            "capacity_share": cell.capacity_share(cal),
            "routers": figures,
            "bound": asdict(bounds[name]),
        }
        for router, values in figures.items():
            row = [name, router, *(f"{values[f]:.3g}" for f in FIGURES)]
            print("| " + " | ".join(row) + " |", flush=True)
    print(
        "\nPer 1k requests (sim.bound): floors for any router (Belady MIN, requests in arrival "
        "order, any warm-up) and for any router that does not know the requests to come (A0's "
        "expected misses under the cell's popularity); A0 and the fleet as one LRU cache on "
        "the cell's requests"
    )
    for name, b in bounds.items():
        print(
            f"{name}: GPU loads >= {b.loads_floor_per_1k:.0f}, online >= "
            f"{b.online_loads_floor_per_1k:.0f} (A0 on these requests "
            f"{b.a0_loads_per_1k:.0f}, LRU {b.lru_loads_per_1k:.0f}) over {b.gpu_entries} "
            f"slots; disk reads >= {b.disk_reads_floor_per_1k:.0f}, online >= "
            f"{b.online_disk_reads_floor_per_1k:.0f} (A0 {b.a0_disk_reads_per_1k:.0f}, LRU "
            f"{b.lru_disk_reads_per_1k:.0f}) over {b.memory_entries} host entries"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
