"""The app through HTTP: deploy it on a local Ray cluster as `serve run` would, warm it up, send
each stream through `loadgen`, and read every engine replica's stats around each run (requests
finished, busy share). For a sweep workload, the goodput search runs here."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from app.config import AppArgs
from benchmarks.common import wait_healthy
from benchmarks.serve_cpu import (
    busiest_threads,
    cpu_per_token,
    cpu_seconds,
    read_all,
    read_threads,
    serving_processes,
    tcp_counters,
)
from benchmarks.serve_goodput import Goodput, Objectives, search
from benchmarks.serve_report import (
    Measured,
    fleet_figures,
    replica_timeline,
    row,
    slowest_steps_of,
    step_figures,
)
from benchmarks.serve_workloads import Stream, Workload
from loadgen import OpenAIClient, RequestSpec, run_benchmark
from loadgen.runner import warm_up
from loadgen.shards import ShardedClient

APP_NAME = "bench-serve"
ENGINE_DEPLOYMENT = "EngineDeployment"
INGRESS_DEPLOYMENT = "Ingress"


async def replica_stats(handle) -> dict[str, dict[str, Any]]:
    answers = await handle.broadcast("replica_stats").results_async(timeout_s=60)
    return {a["replica_id"]: a for a in answers}


SAMPLE_EVERY_S = 0.25


async def sample_queues(
    handle, t0: float, stop: asyncio.Event, samples: list[tuple[float, str, int, int]]
) -> None:
    """Every replica's running and waiting requests every SAMPLE_EVERY_S until `stop`
    (`replica_timeline`). A round that fails (a replica busy past the broadcast's deadline)
    is skipped: the samples are a view of the run, not part of it."""
    while not stop.is_set():
        asked = time.monotonic()
        try:
            answers = await replica_stats(handle)
        except Exception:  # noqa: BLE001 - a missed round, reported by its absence
            answers = {}
        t = (asked + time.monotonic()) / 2 - t0  # a round's answers: read between the two
        for rid, a in answers.items():
            samples.append((t, rid, int(a["num_running"]), int(a["num_waiting"])))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


PROFILE_S = 15.0  # how long --profile samples by default


async def http_run(
    client: OpenAIClient | ShardedClient,
    handle,
    stream: Stream,
    profile: str | None = None,
    profile_s: float = PROFILE_S,
) -> Measured:
    """One stream through HTTP. With `profile` (a folder), py-spy samples every serving
    process for `profile_s` from the stream's start (collapsed stacks, one file a process):
    a few seconds profile a burst's ramp alone."""
    processes = await asyncio.to_thread(
        serving_processes, APP_NAME, INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT
    )
    if profile is not None:
        start_profilers(processes, profile, profile_s)
    before = await replica_stats(handle)
    cpu_before = read_all(processes)
    threads_before = read_threads(processes)
    # The load generator: this process (with Ray's driver) and its worker processes, if any.
    workers = client.worker_pids() if isinstance(client, ShardedClient) else []

    def client_cpu() -> float:
        return time.process_time() + sum(cpu_seconds(pid) or 0.0 for pid in workers)

    client_before = client_cpu()
    tcp_before = tcp_counters()
    samples: list[tuple[float, str, int, int]] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_queues(handle, t0, stop, samples))
    try:
        result = await run_benchmark(
            client, stream.specs, [stream.load], warmup=0, progress=sys.stderr.isatty()
        )
    finally:
        stop.set()
        await sampler
    client_cpu_s = client_cpu() - client_before
    tcp_after = tcp_counters()
    report = result.runs[0]
    cpu_after = read_all(processes)
    threads_after = read_threads(processes)
    after = await replica_stats(handle)
    since = {rid: int(b.get("num_steps", 0)) for rid, b in before.items()}
    slow = await handle.broadcast("slowest_steps", since).results_async(timeout_s=60)
    requests, busy = fleet_figures(before, after, report.summary["duration_s"])
    step_cpu = sum(
        float(a.get("step_cpu_s", 0.0)) - float(before.get(rid, {}).get("step_cpu_s", 0.0))
        for rid, a in after.items()
    )
    cpu = cpu_per_token(
        processes,
        cpu_before,
        cpu_after,
        report.summary["total_output_tokens"],
        step_cpu,
        client_cpu_s=client_cpu_s,
    )
    cpu["load_generator_cores"] = client_cpu_s / max(report.summary["duration_s"], 1e-9)
    cpu["threads_cpu_s"] = busiest_threads(processes, threads_before, threads_after)
    return Measured(
        report.summary,
        busy,
        requests,
        cpu,
        step_figures(before, after),
        replica_timeline(samples),
        {k: tcp_after[k] - tcp_before[k] for k in tcp_after if k in tcp_before},
        slowest_steps_of(slow, t0),
    )


def start_profilers(processes: list, folder: str, seconds: float = PROFILE_S) -> None:
    if shutil.which("py-spy") is None:
        print("warning: --profile needs py-spy on the PATH; not profiling", flush=True)
        return
    os.makedirs(folder, exist_ok=True)
    for p in processes:
        out = os.path.join(folder, f"{p.role}-{p.pid}.txt")
        duration = str(max(1, round(seconds)))  # py-spy takes whole seconds
        subprocess.Popen(["py-spy", "record", "--pid", str(p.pid), "--duration", duration,
                          "--rate", "100", "--format", "raw", "--nonblocking", "-o", out],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


@dataclass
class HttpPhase:
    measured: dict[str, Measured]  # stream label -> figures
    streams: list[Stream]  # as measured (a sweep's at the goodput rate)
    goodput: Goodput | None = None
    capacity_req_s: float | None = None
    idle_cores: dict[str, float] | None = None  # idle_cores, before the first stream


IDLE_S = 5.0  # how long the serving processes are read with no request in flight


async def idle_cores(seconds: float = IDLE_S) -> dict[str, float]:
    """Cores each role's processes use with no request in flight, over `seconds` (their
    threads' busiest names beside them): what a role spends whatever the load, which a run's
    per-token figure holds at its duration's worth."""
    processes = await asyncio.to_thread(
        serving_processes, APP_NAME, INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT
    )
    before, threads_before = read_all(processes), read_threads(processes)
    await asyncio.sleep(seconds)
    after, threads_after = read_all(processes), read_threads(processes)
    cores: dict[str, float] = {}
    for p in processes:
        if p.pid in before and p.pid in after:
            cores[p.role] = cores.get(p.role, 0.0) + (after[p.pid] - before[p.pid]) / seconds
    threads = busiest_threads(processes, threads_before, threads_after, top=4)
    return {
        **{role: round(c, 4) for role, c in sorted(cores.items())},
        **{f"{role} threads": [(n, round(s / seconds, 4)) for n, s in names]
           for role, names in sorted(threads.items())},  # fmt: skip
    }


async def http_phase(
    url: str,
    wl: Workload,
    work: list[Stream],
    warm: list[RequestSpec],
    timeout_s: float,
    profile_dir: str | None = None,
    profile_stream: int = 0,
    clients: int = 1,
    profile_s: float = PROFILE_S,
) -> HttpPhase:
    """Warm up, then each stream through HTTP, sent by `clients` load generator processes
    (this one alone when 1)."""
    from ray import serve

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    if clients > 1:
        sender: OpenAIClient | ShardedClient = ShardedClient(
            url, clients, request_timeout_s=timeout_s
        )
    else:
        sender = OpenAIClient(url, request_timeout_s=timeout_s)
    async with sender as client:
        records = await warm_up(client, warm, len(warm))
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed: {failed[0].error}")
        await asyncio.sleep(1.0)  # residency reports reach the router
        idle = await idle_cores()
        print("idle cores", json.dumps(idle), flush=True)
        if wl.sweep_steps:
            phase = await sweep(client, handle, wl, work[0], timeout_s)
            phase.idle_cores = idle
            return phase
        measured = {}
        for k, stream in enumerate(work):
            profile = profile_dir if k == profile_stream else None
            measured[stream.label] = await http_run(client, handle, stream, profile, profile_s)
            print(stream.label, json.dumps(row(stream.label, "http", measured[stream.label])),
                  flush=True)  # fmt: skip
        return HttpPhase(measured, work, idle_cores=idle)


async def sweep(client, handle, wl: Workload, stream: Stream, timeout_s: float) -> HttpPhase:
    """The capacity from a burst of the stream's requests, then the goodput search over
    [capacity / 8, capacity]; the figures at the goodput rate are the stream's."""
    burst = await http_run(client, handle, stream.at(math.inf))
    capacity = burst.summary["request_throughput"] or 1.0
    at_rate: dict[float, Measured] = {}

    async def measure(rate: float) -> dict:
        timeout = min(timeout_s, 1.5 * len(stream.specs) / rate + 60.0)
        point = Stream(stream.label, stream.specs,
                       replace(stream.load, request_rate=rate, timeout_s=timeout))  # fmt: skip
        measured = await http_run(client, handle, point)
        at_rate[rate] = measured
        print(f"rate {rate:.3g}:", json.dumps(row(stream.label, "http", measured)), flush=True)
        return measured.summary

    found = await search(measure, capacity / 8, capacity, wl.sweep_steps, Objectives())
    rate = found.rate if found.rate is not None else capacity / 8
    label = f"{stream.label} at {rate:.3g} req/s"
    chosen = Stream(label, stream.specs, replace(stream.load, request_rate=rate))
    return HttpPhase({label: at_rate[rate]}, [chosen], found, capacity)


def deploy_and_measure(
    args: argparse.Namespace, app: AppArgs, wl: Workload, work: list[Stream],
    warm: list[RequestSpec],
) -> HttpPhase:  # fmt: skip
    """Start a local Ray cluster and Serve on `args.port`, deploy, measure, shut both down. In a
    process already connected to a cluster with Serve running on `args.port` (the tests'), the
    app is deployed there and deleted after."""
    import ray
    from ray import serve

    from app.main import CONTROLLER_OPTIONS, build_app

    owned = not ray.is_initialized()
    if owned:
        num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        # Serve reserves a CPU a replica: room for every replica, whatever this machine's cores.
        cpus = max(os.cpu_count() or 1, args.replicas + app.ingress_replicas(args.device) + 1)
        ray.init(num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False)
    url = f"http://127.0.0.1:{args.port}"

    async def measure_then_shut_down() -> HttpPhase:
        try:
            return await http_phase(url, wl, work, warm, args.run_timeout, args.profile,
                                    args.profile_stream, args.clients, args.profile_s)  # fmt: skip
        finally:
            # On the loop the handles ran on: with Serve's router on the caller's loop
            # (RAY_SERVE_THROUGHPUT_OPTIMIZED=1), a shutdown after that loop closed fails.
            if owned:
                await serve.shutdown_async()
            else:
                await asyncio.to_thread(serve.delete, APP_NAME)

    try:
        if owned:
            serve.start(
                http_options={"host": "127.0.0.1", "port": args.port},
                controller_options=CONTROLLER_OPTIONS,
            )
        serve.run(build_app(app), name=APP_NAME, route_prefix="/")
        wait_healthy(url)
        return asyncio.run(measure_then_shut_down())
    finally:
        if owned:
            serve.shutdown()  # when the phase never ran; nothing to do after it
            ray.shutdown()
