"""Routers compared on a real Serve deployment: the churn workload through HTTP, one engine
replica per GPU, every router in the same run.

    python -m benchmarks.bench_router_serve --replicas 2 --num-adapters 64 --rank 16 --slots 8 \
        --rate 6 --num-requests 300 --popularity skewed,uniform --out benchmarks/results
    python -m benchmarks.bench_router_serve --cell placement-2x --out benchmarks/results
    python -m benchmarks.bench_router_serve --smoke     # CPU, tiny model, under two minutes

`--cell NAME` runs one of the routing cells of `sim/cells.py` (placement-, easy- and hot-, on
2x and 4x replicas; docs/perf/routing_sim.md) and names the results after it; options given
beside it override the cell's.

For each router (affinity with the router's prefetch hints, affinity without them, Ray Serve's
default power of two choices), the app is deployed in-process (`serve.run(build_app(args))`)
with a Llama-3-8B-shaped model of random weights (`load_format: dummy`) and many rank-r adapters
that share a few weight files. On that deployment each popularity's workload runs after a
warm-up burst of its own (every adapter in turn, uncounted); the workloads are seeded, the same
for every router. Serve is shut down before the next router's deployment.

Figures per run: TTFT P50/P99, ITL P50/P99, E2E P50 and throughput (the client's), the GPU-slot
hit rate (admissions that found their adapter in a slot, brought there ahead of time by the
prefetcher included, so near 1 whenever the engines prefetch) and adapter loads into GPU slots
per 1k requests (the routing figure; both from every replica's engine counters), load imbalance
(max / mean of adapter requests finished per replica), the mean time a request waited for its
adapter (the engines' `lorafleet_adapter_wait_seconds` histogram on Ray's metrics export, whose
sum Ray builds from bucket midpoints, so it is good to a bucket's width), and how many replicas
hold each adapter in memory at the end (from GET /v1/adapters). Each row is also set against
pow2 at the same popularity. Beside each real figure goes the fleet simulator's prediction
for the same requests (`sim_<figure>`, `sim/cells.py: predict`, one simulator seed, the
recorded H200 calibration scaled to the rank), computed on the CPU before the first deploy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.common import device_name, free_port, wait_healthy, write_results
from loadgen import LengthRange, LoadConfig, OpenAIClient, RunReport, run_benchmark
from loadgen.runner import warm_up
from replicas.models.spec import ModelSpec
from synthetic.adapters import write_fleet
from synthetic.models import write_model
from synthetic.presets import LLAMA3_8B, TINY
from workloads.requests import RequestSpec, workload_digest
from workloads.router_cell import BASE_MODEL, adapter_names, cell_requests

ENGINE_DEPLOYMENT = "EngineDeployment"
WAIT_METRIC = "ray_lorafleet_adapter_wait_seconds"  # observed once per finished adapter request
METRICS_REPORT_INTERVAL_MS = 500  # how often replicas push metrics to the export (default 10 s)
METRICS_SETTLE_S = 20.0  # how long to wait for the export to show every finished request
HOT_ADAPTER = "lora-0"  # the most popular adapter under skewed, zipf and hot


@dataclass(frozen=True)
class RouterSetup:
    """One router configuration of the comparison."""

    name: str
    router: str  # AppArgs.router
    prefetch_hints: bool  # the affinity router's request_router_kwargs["prefetch_hints"]


ROUTERS = (
    RouterSetup("affinity+hints", "affinity", True),
    RouterSetup("affinity", "affinity", False),
    RouterSetup("pow2", "pow2", False),
)
BASELINE = "pow2"


# ---------------------------------------------------------------------------------------------
# Deployment


def app_args(
    args: argparse.Namespace, setup: RouterSetup, model_dir: Path, adapters: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "served_model_name": BASE_MODEL,
        "load_format": "dummy",
        "adapters": dict(adapters),
        "device": args.device,
        "num_replicas": args.replicas,
        "max_loras_per_batch": args.slots,
        "max_loaded_loras": max(args.host_cache, args.slots),
        "max_lora_rank": args.rank,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        # The engines prefetch from their own queues in every setup; only the router and its
        # hints change.
        "router": setup.router,
        "router_prefetch_hints": setup.prefetch_hints,
    }


def build_application(args: Mapping[str, Any], setup: RouterSetup):
    """`app.main.build_app` for one router setup (`args` from `app_args`)."""
    from app import main

    return main.build_app(dict(args))


# ---------------------------------------------------------------------------------------------
# What the fleet says about itself


@dataclass(frozen=True)
class FleetSnapshot:
    """Every engine replica's counters at one moment: `engines`, one `stats()` answer per
    replica (unordered, unnamed: only their sums are used), and `finished`, adapter requests
    finished per replica id (from the metrics export, where each replica is tagged)."""

    engines: list[dict[str, Any]]
    finished: dict[str, float]
    wait_sum_s: float

    def total(self, key: str) -> int:
        return sum(int(e[key]) for e in self.engines)


def wait_histogram(metrics_url: str, app_name: str) -> tuple[dict[str, float], float]:
    """Adapter requests finished per replica, and the sum of their waits in seconds, from the
    Prometheus text of Ray's metrics export."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    counts: dict[str, float] = {}
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != WAIT_METRIC:
            continue
        for sample in family.samples:
            if sample.labels.get("application") != app_name:
                continue
            if sample.name == f"{WAIT_METRIC}_count":
                replica = sample.labels.get("replica", "")
                counts[replica] = counts.get(replica, 0.0) + sample.value
            elif sample.name == f"{WAIT_METRIC}_sum":
                total += sample.value
    return counts, total


async def snapshot(handle, metrics_url: str, app_name: str) -> FleetSnapshot:
    """The fleet's counters, taken when no request is running. The metrics export trails the
    engines by up to a report interval, so it is read until it shows as many finished adapter
    requests as the engines admitted (or for METRICS_SETTLE_S at most)."""
    engines = list(await handle.broadcast("stats").results_async(timeout_s=60))
    admitted = sum(int(e["adapter_hits"]) + int(e["adapter_misses"]) for e in engines)
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        finished, wait_sum = await asyncio.to_thread(wait_histogram, metrics_url, app_name)
        if sum(finished.values()) >= admitted or time.monotonic() > deadline:
            return FleetSnapshot(engines=engines, finished=finished, wait_sum_s=wait_sum)
        await asyncio.sleep(0.25)


def placement(listing: Mapping[str, Any] | None) -> dict[str, float | None]:
    """From GET /v1/adapters: over the adapters some replica holds, how many replicas hold each
    on GPU (or loading there) and in memory at all, on average; and how many hold the most
    popular adapter on GPU (`hot_gpu`)."""
    if not listing:
        return {"gpu_copies": None, "memory_copies": None, "hot_gpu": None}
    on_gpu, in_memory = [], []
    for card in listing.get("data", []):
        tiers = [p.get("tier") for p in card.get("replicas", [])]
        gpu = sum(t in ("gpu", "loading") for t in tiers)
        memory = sum(t in ("gpu", "loading", "host") for t in tiers)
        if gpu:
            on_gpu.append(gpu)
        if memory:
            in_memory.append(memory)
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    hot = next((c for c in listing.get("data", []) if c.get("id") == HOT_ADAPTER), None)
    hot_gpu = None
    if hot is not None:
        hot_gpu = sum(p.get("tier") in ("gpu", "loading") for p in hot.get("replicas", []))
    return {"gpu_copies": mean(on_gpu), "memory_copies": mean(in_memory), "hot_gpu": hot_gpu}


# ---------------------------------------------------------------------------------------------
# One run


@dataclass(frozen=True)
class Workloads:
    warmup: list[RequestSpec]
    measured: list[RequestSpec]
    load: LoadConfig


def workloads(args: argparse.Namespace, names: list[str], popularity: str) -> Workloads:
    cell = cell_requests(
        names,
        slots=args.slots,
        replicas=args.replicas,
        num_requests=args.num_requests,
        popularity=popularity,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    return Workloads(
        warmup=cell.warmup,
        measured=cell.measured,
        load=LoadConfig(request_rate=args.rate, timeout_s=args.run_timeout, seed=args.seed),
    )


async def measure(url: str, metrics_url: str, app_name: str, work: Workloads) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name)
    async with OpenAIClient(url, request_timeout_s=work.load.timeout_s) as client:
        warm = await warm_up(client, work.warmup, len(work.warmup))
        failed = [r for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed: {failed[0].error}")
        await asyncio.sleep(1.0)  # residency reports reach the routers
        before = await snapshot(handle, metrics_url, app_name)
        result = await run_benchmark(
            client, work.measured, [work.load], warmup=0, progress=sys.stderr.isatty()
        )
        report = result.runs[0]
        after = await snapshot(handle, metrics_url, app_name)
    return figures(report, before, after)


def figures(report: RunReport, before: FleetSnapshot, after: FleetSnapshot) -> dict[str, Any]:
    s = report.summary
    completed = s["completed"]
    grown = {
        key: after.total(key) - before.total(key)
        for key in ("adapter_hits", "adapter_misses", "adapter_gpu_loads",
                    "adapter_disk_reads", "adapter_prefetch_loads")
    }  # fmt: skip
    admissions = grown["adapter_hits"] + grown["adapter_misses"]
    replica_ids = sorted(set(after.finished) | set(before.finished))
    per_replica = [after.finished.get(r, 0.0) - before.finished.get(r, 0.0) for r in replica_ids]
    per_replica += [0.0] * (len(after.engines) - len(per_replica))  # replicas that served none
    served = sum(per_replica)
    per_1k = (lambda n: 1000.0 * n / completed) if completed else (lambda n: None)
    return {
        "sent": s["num_requests"],
        "completed": completed,
        "failed": s["failed"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "itl_p99_ms": s["itl_ms"]["p99"],
        "e2e_p50_s": None if s["e2e_ms"]["p50"] is None else s["e2e_ms"]["p50"] / 1000.0,
        "throughput_tok_s": s["output_token_throughput"],
        "request_throughput": s["request_throughput"],
        "adapter_wait_mean_ms": (
            1000.0 * (after.wait_sum_s - before.wait_sum_s) / served if served else None
        ),
        "hit_rate": grown["adapter_hits"] / admissions if admissions else None,
        "loads_per_1k": per_1k(grown["adapter_gpu_loads"]),
        "disk_reads_per_1k": per_1k(grown["adapter_disk_reads"]),
        "prefetch_loads": grown["adapter_prefetch_loads"],
        "admissions": admissions,
        "requests_per_replica": per_replica,
        "imbalance": max(per_replica) / (served / len(per_replica)) if served else None,
        **placement((report.adapter_stats or {}).get("after")),
        "duration_s": s["duration_s"],
        "errors": s["errors"],
    }


# ---------------------------------------------------------------------------------------------
# Results

# Figures the simulator predicts: each row carries `sim_<figure>` beside the real one.
PREDICTED = (
    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "throughput_tok_s", "hit_rate", "loads_per_1k",
    "disk_reads_per_1k", "imbalance",
)  # fmt: skip
COLUMNS = [
    "popularity", "router", "completed", "ttft_p50_ms", "sim_ttft_p50_ms", "ttft_p99_ms",
    "sim_ttft_p99_ms", "itl_p50_ms", "sim_itl_p50_ms", "itl_p99_ms", "e2e_p50_s",
    "throughput_tok_s", "sim_throughput_tok_s", "adapter_wait_mean_ms", "hit_rate", "loads_per_1k",
    "sim_loads_per_1k", "disk_reads_per_1k", "sim_disk_reads_per_1k", "imbalance",
    "sim_imbalance", "memory_copies", "hot_gpu", "sim_hot_replicas", "ttft_p50_vs_pow2",
    "ttft_p99_vs_pow2", "throughput_vs_pow2", "loads_vs_pow2",
]  # fmt: skip
RATIOS = {
    "ttft_p50_vs_pow2": "ttft_p50_ms",
    "ttft_p99_vs_pow2": "ttft_p99_ms",
    "itl_p99_vs_pow2": "itl_p99_ms",
    "e2e_p50_vs_pow2": "e2e_p50_s",
    "throughput_vs_pow2": "throughput_tok_s",
    "loads_vs_pow2": "loads_per_1k",
    "hit_rate_vs_pow2": "hit_rate",
}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its figures divided by pow2's at the same popularity (None where pow2 has
    not run yet or its figure is 0)."""
    baseline = {r["popularity"]: r for r in rows if r["router"] == BASELINE}
    out = []
    for row in rows:
        base = baseline.get(row["popularity"])
        ratios = {}
        for name, key in RATIOS.items():
            a, b = row.get(key), base.get(key) if base else None
            ratios[name] = a / b if a is not None and b else None
        out.append({**row, **ratios})
    return out


def cell_of(args: argparse.Namespace, popularity: str):
    """The run's shape as a `sim.cells.RouterCell`, for one popularity."""
    from sim.cells import RouterCell

    values = {f.name: getattr(args, f.name) for f in fields(RouterCell) if hasattr(args, f.name)}
    values.update(
        # One router per ingress replica: AppArgs.ingress_replicas' default on the device.
        num_routers=2 * args.replicas if args.device == "cuda" else 1,
        popularity=popularity,
        input_len=(args.input_len.low, args.input_len.high),
        output_len=(args.output_len.low, args.output_len.high),
    )
    return RouterCell(**values)


def predictions(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, float]]:
    """(popularity, router) -> `sim_<figure>` for every run of `args`, from the fleet simulator
    on the same requests (`sim.cells.predict`, `--sim-seeds` seeds)."""
    from sim.cells import calibration, predict, served_path

    cal = calibration()
    routers = [setup.name for setup in args.setups]
    out = {}
    for popularity in args.popularity.split(","):
        for router, figures in predict(
            cell_of(args, popularity),
            cal,
            routers,
            seeds=args.sim_seeds,
            served=served_path(cal=cal),
        ).items():
            out[popularity, router] = {
                f"sim_{name}": figures[name] for name in (*PREDICTED, "hot_replicas")
            }
    return out


def git_commit() -> str:
    """$COMMIT, else the checkout's HEAD, else "unknown" (a copy of the tree without .git)."""
    import subprocess

    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def save(args: argparse.Namespace, rows: list[dict], meta: dict[str, Any]) -> Path:
    order = {kind: i for i, kind in enumerate(args.popularity.split(","))}
    routers = {setup.name: i for i, setup in enumerate(ROUTERS)}
    return write_results(
        args.out,
        f"router_serve_{args.name}",
        f"Routers on a Serve deployment: {args.replicas} replicas, {args.num_adapters} "
        f"rank-{args.rank} adapters over {args.slots} slots each, Poisson {args.rate:g} req/s",
        f"each router against {BASELINE} (Ray Serve's default) at the same popularity, same run; "
        "sim_<figure>: the fleet simulator's prediction for the same requests",
        COLUMNS,
        sorted(with_ratios(rows), key=lambda r: (order[r["popularity"]], routers[r["router"]])),
        meta,
    )


# ---------------------------------------------------------------------------------------------
# The command

# Options whose default depends on --smoke: the full run's, then the smoke run's.
FULL = dict(
    replicas=2, num_adapters=64, rank=16, slots=8, rate=6.0, num_requests=300,
    popularity="skewed,uniform", input_len="128:512", output_len="32:96", max_model_len=2048,
    device="auto",
)  # fmt: skip
SMOKE = dict(
    replicas=2, num_adapters=8, rank=4, slots=2, rate=8.0, num_requests=24,
    popularity="skewed", input_len="8:32", output_len="4:8", max_model_len=128, device="cpu",
)  # fmt: skip


def add_run_options(
    ap: argparse.ArgumentParser, results_prefix: str, run_timeout_s: float, smoke: str
) -> None:
    """The options every serving benchmark takes: Serve's port, the run's timeout and seed,
    where results and the written model go, and `--smoke` (`smoke`: what it runs)."""
    ap.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    ap.add_argument(
        "--run-timeout",
        type=float,
        default=run_timeout_s,
        help="seconds one measured run may last",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--name", default=None, help=f"results file: {results_prefix}_<name>.{{md,json}}"
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--work-dir",
        default=None,
        help="where the model and adapters are written (default: a temporary folder)",
    )
    ap.add_argument("--smoke", action="store_true", help=f"{smoke}: checks the code")


def _cell_names() -> list[str]:
    from sim.cells import CELLS

    return list(CELLS)


def cell_defaults(name: str) -> dict[str, Any]:
    """bench options from the cell `name` of sim/cells.py (KeyError when there is none)."""
    from sim.cells import CELLS

    c = CELLS[name]
    return dict(
        replicas=c.replicas, num_adapters=c.num_adapters, rank=c.rank, slots=c.slots,
        host_cache=c.host_cache, rate=c.rate, num_requests=c.num_requests,
        popularity=c.popularity, input_len=f"{c.input_len[0]}:{c.input_len[1]}",
        output_len=f"{c.output_len[0]}:{c.output_len[1]}", max_model_len=c.max_model_len,
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Defaults: "
        + ", ".join(f"{k}={v}" for k, v in FULL.items())
        + "; with --smoke: "
        + ", ".join(f"{k}={v}" for k, v in SMOKE.items()),
    )
    ap.add_argument(
        "--cell",
        default=None,
        help="a routing cell of sim/cells.py (" + ", ".join(_cell_names()) + "): its shape, "
        "rate and popularity are the defaults",
    )
    ap.add_argument(
        "--sim-seeds", type=int, default=1, help="simulator seeds per prediction (0: none)"
    )
    ap.add_argument("--replicas", type=int, help="engine replicas (one GPU each on cuda)")
    ap.add_argument("--num-adapters", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--slots", type=int, help="GPU adapter slots per replica")
    ap.add_argument(
        "--host-cache",
        type=int,
        default=None,
        help="adapters in host memory per replica (default: all of them)",
    )
    ap.add_argument("--rate", type=float, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--input-len", help="prompt tokens, N or LOW:HIGH")
    ap.add_argument("--output-len", help="output tokens, N or LOW:HIGH")
    ap.add_argument("--popularity", help="comma-separated: distinct, uniform, skewed, zipf, hot")
    ap.add_argument(
        "--routers",
        default=",".join(r.name for r in ROUTERS),
        help="comma-separated subset of " + ", ".join(r.name for r in ROUTERS),
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"])
    add_run_options(
        ap, "router_serve", 600.0, "CPU, tiny model, 2 replicas, few adapters and requests"
    )
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the results' command line
    if args.cell is not None:
        if args.smoke:
            ap.error("--cell and --smoke do not go together")
        try:
            defaults = cell_defaults(args.cell)
        except KeyError:
            ap.error(f"unknown cell {args.cell!r}; choose from {_cell_names()}")
        for key, value in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.input_len = LengthRange.parse(args.input_len)
    args.output_len = LengthRange.parse(args.output_len)
    args.host_cache = args.host_cache or args.num_adapters
    if args.name is None and args.cell is not None:
        args.name = args.cell
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.name is None:
        args.name = (
            "smoke"
            if args.smoke
            else (f"{args.replicas}x_{args.num_adapters}a_r{args.rank}_s{args.slots}")
        )
    known = {r.name: r for r in ROUTERS}
    unknown = [n for n in args.routers.split(",") if n not in known]
    if unknown:
        ap.error(f"unknown routers {unknown}; choose from {sorted(known)}")
    args.setups = [known[n] for n in args.routers.split(",")]
    if args.device == "cuda" and args.replicas > torch.cuda.device_count():
        ap.error(f"{args.replicas} replicas need as many GPUs; {torch.cuda.device_count()} visible")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Start a local Ray cluster and Serve, run the comparison on them (`run`), shut both down."""
    import ray
    from ray import serve

    from app.main import CONTROLLER_OPTIONS

    args = parse_args(argv)
    # The results name the device through torch, which opens a CUDA context in this process:
    # open it before any replica sizes its KV cache, so that every deployment sees the same.
    device_name()
    metrics_port = free_port()
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    ray.init(
        num_cpus=max(os.cpu_count() or 1, args.replicas + 2),
        num_gpus=num_gpus,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": args.port}, controller_options=CONTROLLER_OPTIONS
    )
    try:
        url = f"http://127.0.0.1:{args.port}"
        return run(args, url, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


def run(args: argparse.Namespace, url: str, metrics_url: str) -> Path:
    """Every setup of `args` (from `parse_args`) on a Ray cluster where Serve is already up:
    its proxy at `url`, Ray's metrics export at `metrics_url`, the cluster started with
    `metrics_report_interval_ms` = METRICS_REPORT_INTERVAL_MS. Each setup's app is deleted after
    its runs; the cluster and Serve are left as they were. Returns the results' markdown path."""
    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": "python -m benchmarks.bench_router_serve " + shlex.join(args.argv),
        "commit": git_commit(),
    }
    predicted: dict[tuple[str, str], dict[str, float]] = {}
    if args.sim_seeds > 0:
        t0 = time.monotonic()
        predicted = predictions(args)
        meta["simulator"] = (
            f"sim.cells.predict, {args.sim_seeds} seed(s), {time.monotonic() - t0:.0f} s; "
            "HTTP, proxy, ingress and the slower steps under Serve: sim.cells.served_path, measured"
        )
    model_config = TINY if args.smoke else LLAMA3_8B
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="router-serve-"))
    model_dir = write_model(root, model_config)
    names = adapter_names(args.num_adapters)
    fleet = write_fleet(root, ModelSpec.from_dir(model_dir), names, args.rank)
    print(f"model and {len(fleet)} adapters written to {root}", flush=True)
    meta.update(
        replicas=args.replicas,
        engine_device=args.device,
        model=("tiny " if args.smoke else "Llama-3-8B-shaped ") + "(load_format dummy)",
        args={k: str(v) for k, v in vars(args).items() if k not in ("setups", "argv")},
    )
    works = {kind: workloads(args, names, kind) for kind in args.popularity.split(",")}
    meta["digests"] = {kind: workload_digest(w.measured) for kind, w in works.items()}
    rows: list[dict] = []
    path = None
    for setup in args.setups:
        for row in run_setup(
            args, setup, works, app_args(args, setup, model_dir, fleet), url, metrics_url
        ):
            row.update(predicted.get((row["popularity"], row["router"]), {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
            meta["elapsed_s"] = time.monotonic() - started
            path = save(args, rows, meta)  # after every run: a cut-off run keeps its rows
    print(f"done in {time.monotonic() - started:.0f} s: {path}", flush=True)
    return path


def run_setup(
    args: argparse.Namespace,
    setup: RouterSetup,
    works: Mapping[str, Workloads],
    application_args: Mapping[str, Any],
    url: str,
    metrics_url: str,
) -> Iterator[dict[str, Any]]:
    """Deploy the app under `setup`, run each popularity's workload on it (each after its own
    warm-up), yield a row per run, and delete the app (Serve's controller and proxy stay up for
    the next setup; the replicas are gone before the next deploy)."""
    from ray import serve

    app_name = f"router-{setup.name.replace('+', '-')}"
    t0 = time.monotonic()
    try:
        serve.run(build_application(application_args, setup), name=app_name, route_prefix="/")
        wait_healthy(url)
        deploy_s = time.monotonic() - t0
        for popularity, work in works.items():
            started = time.monotonic()
            row = asyncio.run(measure(url, metrics_url, app_name, work))
            yield {
                "popularity": popularity,
                "router": setup.name,
                **row,
                "deploy_s": deploy_s,
                "run_s": time.monotonic() - started,
            }
    finally:
        serve.delete(app_name)


if __name__ == "__main__":
    main()
