"""The serving benchmark: the real app through HTTP, the engine in-process and the hardware's
floor, on the same request stream, in one run.

    python -m benchmarks.bench_serve --workload saturated            # one GPU
    python -m benchmarks.bench_serve --workload poisson              # goodput sweep
    python -m benchmarks.bench_serve --workload seeds                # beside SGLang's figures
    python -m benchmarks.bench_serve --workload saturated --replicas 2
    python -m benchmarks.bench_serve --smoke                         # CPU, tiny model, ~1 min

Each workload is a model shape with random weights (`load_format: dummy`), rank-r adapters and a
seeded request stream (loadgen: prompts of token ids, exact output lengths, arrival times). The
run:
1. measures the device's two ceilings: a bf16 matrix product of the model's widest shape and a
   1 GiB device copy (`serve_roofline.measure_ceilings`);
2. deploys the app as `serve run` would (`app.main.build_app` on `AppArgs`, the `args:` block a
   user writes; `--set KEY=VALUE` changes any of them), warms it up, and streams every request
   through HTTP (`/v1/completions`): output tok/s, TTFT, ITL and E2E P50/P90/P99 as the client
   sees them, and from the engine replicas' stats (`EngineDeployment.replica_stats`) requests
   finished per replica and each replica's busy share (time inside engine steps / run time);
3. shuts Serve down and drives the engine in-process (`serve_engine.drive`: `replicas.engine.
   Engine` built from the same `AppArgs`, no Ray, no HTTP) on the identical requests and
   arrival times, after a warm-up of its own;
4. computes the workload's roofline from the two ceilings (`serve_roofline`):
       roofline_s = (2 * P * prompt tokens / GEMM rate
                     + (decode steps * weight bytes + KV bytes read) / HBM bandwidth) / replicas
   with decode at full batch (steps = decode tokens / max_num_seqs), each step reading the
   weights and every running request's KV cache once; P counts the layers' projections and
   the LM head.

Ratios: HTTP / in-process (in-process is one engine on one GPU: with `--replicas N` the HTTP
figure is set against N times it), in-process / roofline (per GPU), and, where a workload runs
several adapter counts on the same prompts, the first count's tok/s over the last's.

Workloads (`--workload`):
  saturated  Llama-3-8B shape, 32 rank-16 adapters in 32 slots, 512 requests sent at once,
             prompts 128-512 tokens, 128 output tokens; then the same prompts all on ONE adapter
             (same deployment, same run): the 32-vs-1 ratio is the price of many adapters.
  poisson    the saturated shape with 32 adapters under Poisson arrivals: a burst of the sweep's
             requests gives the capacity C (requests/s); goodput is the highest rate in
             [C/8, C] whose TTFT P99 <= 1 s and ITL P99 <= 100 ms, by bisection
             (`serve_goodput.search`, each point a short run). The in-process engine then runs
             the same requests at the goodput rate.
  seeds      Llama-3.1-8B shape, one rank-16 adapter, 480 prompts at 8 req/s Poisson, prompts
             200-1000 tokens, outputs 100-400; SGLang's published TTFT P50 62.65 ms and ITL P50
             22.68 ms beside ours.

Results: benchmarks/results/bench_serve_<workload>[_<N>x][_smoke].{md,json}, with the command,
device, date, ceilings, every figure and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from app.config import AppArgs
from benchmarks.bench_churn import LLAMA3_8B, TINY, write_fleet
from benchmarks.bench_router_serve import adapter_names, wait_healthy, write_model
from benchmarks.common import append_table, device_name, write_results
from benchmarks.loadgen import (
    LengthRange,
    LoadConfig,
    OpenAIClient,
    RequestSpec,
    WorkloadConfig,
    build_workload,
    run_benchmark,
    summarize,
)
from benchmarks.loadgen.arrivals import arrival_offsets
from benchmarks.loadgen.runner import warm_up
from benchmarks.loadgen.workload import rng_for, workload_digest
from benchmarks.serve_engine import drive
from benchmarks.serve_goodput import Goodput, Objectives, search
from benchmarks.serve_roofline import FORMULA, Roofline, measure_ceilings, roofline
from replicas.models.spec import ModelSpec

BASE_MODEL = "base"
APP_NAME = "bench-serve"
ENGINE_DEPLOYMENT = "EngineDeployment"
WARMUP_OUTPUT_TOKENS = 8
LLAMA31_8B = {
    **LLAMA3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


# ---------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Workload:
    """A named workload: the model, the adapters, the requests and how they arrive. Each count
    in `adapter_counts` is a stream of its own over the same prompts and lengths."""

    name: str
    shape: str  # the model's name, for the results
    model: Mapping[str, Any]  # config.json of a Llama-shaped model (weights: dummy)
    adapter_counts: tuple[int, ...]
    rank: int
    slots: int  # max_loras_per_batch
    num_requests: int
    input_len: LengthRange
    output_len: LengthRange
    rate: float  # requests/s, Poisson; inf: all at once
    max_num_seqs: int
    max_model_len: int
    sweep_steps: int = 0  # > 0: a goodput sweep of this many bisection steps
    published: tuple[str, dict[str, float]] | None = None  # source, {figure: value}

    @property
    def num_adapters(self) -> int:
        return max(self.adapter_counts)


def _range(text: str) -> LengthRange:
    return LengthRange.parse(text)


SATURATED = Workload(
    name="saturated", shape="Llama-3-8B", model=LLAMA3_8B, adapter_counts=(32, 1), rank=16,
    slots=32, num_requests=512, input_len=_range("128:512"), output_len=_range("128"),
    rate=math.inf, max_num_seqs=128, max_model_len=1024,
)  # fmt: skip
WORKLOADS = {
    "saturated": SATURATED,
    "poisson": replace(
        SATURATED, name="poisson", adapter_counts=(32,), num_requests=160, sweep_steps=3
    ),
    "seeds": Workload(
        name="seeds", shape="Llama-3.1-8B", model=LLAMA31_8B, adapter_counts=(1,), rank=16,
        slots=1, num_requests=480, input_len=_range("200:1000"), output_len=_range("100:400"),
        rate=8.0, max_num_seqs=128, max_model_len=2048,
        published=("SGLang", {"ttft_p50_ms": 62.65, "itl_p50_ms": 22.68}),
    ),
}  # fmt: skip
# `--smoke`: the same code on CPU with a tiny model and a handful of requests.
TINY_SIZES = dict(shape="tiny", model=TINY, rank=4, max_num_seqs=8, max_model_len=128)
SMOKE = {
    "saturated": replace(
        SATURATED, **TINY_SIZES, adapter_counts=(4, 1), slots=4, num_requests=12,
        input_len=_range("8:32"), output_len=_range("8"),
    ),
    "poisson": replace(
        WORKLOADS["poisson"], **TINY_SIZES, adapter_counts=(4,), slots=4, num_requests=8,
        input_len=_range("8:32"), output_len=_range("8"), sweep_steps=1,
    ),
    "seeds": replace(
        WORKLOADS["seeds"], **TINY_SIZES, num_requests=12, input_len=_range("16:48"),
        output_len=_range("4:12"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Stream:
    """The requests of one measured run and how they arrive: `offsets()` are the send times
    `run_load` uses for `load` (same generator, same seed), so HTTP and in-process see the same
    arrivals."""

    label: str
    specs: list[RequestSpec]
    load: LoadConfig

    def offsets(self) -> np.ndarray:
        return arrival_offsets(
            len(self.specs),
            self.load.request_rate,
            self.load.burstiness,
            rng_for(self.load.seed, "arrivals"),
        )

    def at(self, rate: float) -> Stream:
        return Stream(self.label, self.specs, replace(self.load, request_rate=rate))


def adapters_label(count: int) -> str:
    return f"{count} adapter" + ("s" if count != 1 else "")


def streams(wl: Workload, names: Sequence[str], seed: int, timeout_s: float) -> list[Stream]:
    """One stream per adapter count: the same prompts and lengths (loadgen draws them from
    generators of their own), adapters picked uniformly among the first `count` names."""
    out = []
    for count in wl.adapter_counts:
        specs = build_workload(
            WorkloadConfig(
                num_prompts=wl.num_requests,
                input_len=wl.input_len,
                output_len=wl.output_len,
                adapters=tuple(names[:count]),
                base_model=BASE_MODEL,
                popularity="uniform",
                seed=seed,
            )
        )
        load = LoadConfig(request_rate=wl.rate, timeout_s=timeout_s, seed=seed)
        out.append(Stream(adapters_label(count), specs, load))
    return out


def warmup_specs(wl: Workload, names: Sequence[str], replicas: int, seed: int) -> list[RequestSpec]:
    """A burst over every adapter in turn with short outputs: full batches, every prompt length
    and every slot in use on each replica before anything is timed."""
    count = min(wl.num_requests, max(wl.num_adapters, wl.max_num_seqs)) * replicas
    short = min(WARMUP_OUTPUT_TOKENS, wl.output_len.high)
    return build_workload(
        WorkloadConfig(
            num_prompts=max(count, 2),
            input_len=wl.input_len,
            output_len=LengthRange(short, short),
            adapters=tuple(names),
            base_model=BASE_MODEL,
            popularity="distinct",
            seed=seed + 1,
        )
    )


# ---------------------------------------------------------------------------------------------
# Figures


@dataclass
class Measured:
    """One stream's figures on one path."""

    summary: dict  # loadgen.metrics.summarize
    busy_share: list[float] = field(default_factory=list)  # per replica (one in-process)
    requests_per_replica: list[int] = field(default_factory=list)


def fleet_figures(
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
    duration_s: float,
) -> tuple[list[int], list[float]]:
    """Requests finished per replica and each replica's busy share over a run, from
    `replica_stats` answers keyed by replica id, taken before and after it (a replica missing
    before counts from zero). Replicas in id order."""
    requests, busy = [], []
    for rid in sorted(after):
        prior = before.get(rid, {})
        requests.append(int(after[rid]["num_finished"]) - int(prior.get("num_finished", 0)))
        grown = float(after[rid]["busy_s"]) - float(prior.get("busy_s", 0.0))
        busy.append(grown / duration_s if duration_s > 0 else 0.0)
    return requests, busy


def row(label: str, path: str, m: Measured) -> dict[str, Any]:
    s = m.summary
    figures = {
        "stream": label,
        "path": path,
        "completed": s["completed"],
        "failed": s["failed"],
        "throughput_tok_s": s["output_token_throughput"],
        "request_throughput": s["request_throughput"],
        "duration_s": s["duration_s"],
    }
    for name, key, scale in (("ttft", "ttft_ms", 1.0), ("itl", "itl_ms", 1.0),
                             ("e2e", "e2e_ms", 1e-3)):  # fmt: skip
        unit = "s" if name == "e2e" else "ms"
        for p in ("p50", "p90", "p99"):
            v = s[key][p]
            figures[f"{name}_{p}_{unit}"] = None if v is None else v * scale
    figures["busy_share"] = (
        sum(m.busy_share) / len(m.busy_share) if m.busy_share else None
    )  # the replicas' mean
    figures["requests_per_replica"] = m.requests_per_replica or None
    return figures


def roofline_row(label: str, roof: Roofline) -> dict[str, Any]:
    return {
        "stream": label,
        "path": "roofline",
        "throughput_tok_s": roof.tok_s,
        "duration_s": roof.seconds,
    }


def ratios(
    rows: Sequence[Mapping[str, Any]],
    replicas: int,
    published: tuple[str, Mapping[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Per stream: HTTP / (replicas x in-process) and replicas x in-process / roofline tok/s,
    HTTP / roofline; TTFT and ITL P50 over published figures. Across streams (adapter counts):
    the first stream's tok/s over each later one's, per path. None where a figure is missing."""
    by = {(r["stream"], r["path"]): r for r in rows}
    labels = list(dict.fromkeys(r["stream"] for r in rows))

    def tok(label: str, path: str) -> float | None:
        r = by.get((label, path))
        return None if r is None else r.get("throughput_tok_s")

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = []
    for label in labels:
        http, local, roof = tok(label, "http"), tok(label, "in-process"), tok(label, "roofline")
        local_fleet = None if local is None else replicas * local
        out.append({"ratio": f"{label}: HTTP / in-process", "value": div(http, local_fleet)})
        out.append({"ratio": f"{label}: in-process / roofline", "value": div(local_fleet, roof)})
        out.append({"ratio": f"{label}: HTTP / roofline", "value": div(http, roof)})
        if published is not None:
            source, figures = published
            for path in ("http", "in-process"):
                for key, value in figures.items():
                    ours = (by.get((label, path)) or {}).get(key)
                    out.append({"ratio": f"{label}: {path} {key} / {source}",
                                "value": div(ours, value)})  # fmt: skip
    first = labels[0] if labels else None
    for label in labels[1:]:
        for path in ("http", "in-process"):
            out.append({
                "ratio": f"{path} tok/s: {first} / {label}",
                "value": div(tok(first, path), tok(label, path)),
            })  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The app through HTTP


async def replica_stats(handle) -> dict[str, dict[str, Any]]:
    answers = await handle.broadcast("replica_stats").results_async(timeout_s=60)
    return {a["replica_id"]: a for a in answers}


async def http_run(client: OpenAIClient, handle, stream: Stream) -> Measured:
    before = await replica_stats(handle)
    result = await run_benchmark(
        client, stream.specs, [stream.load], warmup=0, progress=sys.stderr.isatty()
    )
    report = result.runs[0]
    after = await replica_stats(handle)
    requests, busy = fleet_figures(before, after, report.summary["duration_s"])
    return Measured(report.summary, busy, requests)


@dataclass
class HttpPhase:
    measured: dict[str, Measured]  # stream label -> figures
    streams: list[Stream]  # as measured (a sweep's at the goodput rate)
    goodput: Goodput | None = None
    capacity_req_s: float | None = None


async def http_phase(
    url: str, wl: Workload, work: list[Stream], warm: list[RequestSpec], timeout_s: float
) -> HttpPhase:
    from ray import serve

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    async with OpenAIClient(url, request_timeout_s=timeout_s) as client:
        records = await warm_up(client, warm, len(warm))
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed: {failed[0].error}")
        await asyncio.sleep(1.0)  # residency reports reach the router
        if wl.sweep_steps:
            return await sweep(client, handle, wl, work[0], timeout_s)
        measured = {}
        for stream in work:
            measured[stream.label] = await http_run(client, handle, stream)
            print(stream.label, json.dumps(row(stream.label, "http", measured[stream.label])),
                  flush=True)  # fmt: skip
        return HttpPhase(measured, work)


async def sweep(client, handle, wl: Workload, stream: Stream, timeout_s: float) -> HttpPhase:
    """The capacity from a burst of the stream's requests, then the goodput search over
    [capacity / 8, capacity]; the figures at the goodput rate are the stream's."""
    burst = await http_run(client, handle, stream.at(math.inf))
    capacity = burst.summary["request_throughput"] or 1.0
    at_rate: dict[float, Measured] = {}

    async def measure(rate: float) -> dict:
        n = len(stream.specs)
        point = stream.at(rate)
        point = Stream(
            point.label,
            point.specs,
            replace(point.load, timeout_s=min(timeout_s, 1.5 * n / rate + 60.0)),
        )
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
    import ray
    from ray import serve

    from app.main import build_app

    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas + 2), num_gpus=num_gpus,
             include_dashboard=False)  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(app), name=APP_NAME, route_prefix="/")
        wait_healthy(url)
        return asyncio.run(http_phase(url, wl, work, warm, args.run_timeout))
    finally:
        serve.shutdown()
        ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The engine in-process


def in_process(
    app: AppArgs, model_dir: Path, device: str, work: list[Stream], warm: list[RequestSpec]
) -> dict[str, Measured]:
    from replicas.engine import Engine

    # Ray starts a replica's worker with OMP_NUM_THREADS=1 (its one CPU): on CPU the engine
    # here gets one torch thread too, or it would race the other processes for every core.
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    engine = Engine(app.to_engine_config(model_dir, device))
    try:
        drive(engine, warm, [0.0] * len(warm))
        out = {}
        for stream in work:
            result = drive(engine, stream.specs, stream.offsets().tolist())
            summary = summarize(result.records, result.duration_s)
            busy = [result.busy_s / result.duration_s] if result.duration_s > 0 else []
            out[stream.label] = Measured(summary, busy, [summary["completed"]])
            print(stream.label, json.dumps(row(stream.label, "in-process", out[stream.label])),
                  flush=True)  # fmt: skip
        return out
    finally:
        torch.set_num_threads(threads)
        engine.shutdown()
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def wait_device_free(device: str, share: float = 0.9, timeout_s: float = 60.0) -> None:
    """After Serve's replicas exit, their GPU memory comes back a little later: wait for it, so
    the in-process engine sizes its KV cache as a replica did."""
    if device != "cuda":
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free >= share * total:
            return
        time.sleep(0.5)
    print(f"warning: GPU memory still {1 - free / total:.0%} in use", flush=True)


# ---------------------------------------------------------------------------------------------
# The command


def app_args(
    args: argparse.Namespace, wl: Workload, model_dir: Path, fleet: Mapping[str, str]
) -> AppArgs:
    """The `args:` block a user would write for this workload, with `--set` applied."""
    given = {
        "model": str(model_dir),
        "served_model_name": BASE_MODEL,
        "load_format": "dummy",
        "adapters": dict(fleet),
        "device": args.device,
        "num_replicas": args.replicas,
        "max_loras_per_batch": wl.slots,
        "max_loaded_loras": max(len(fleet), wl.slots),
        "max_lora_rank": wl.rank,
        "max_num_seqs": wl.max_num_seqs,
        "max_model_len": wl.max_model_len,
    }
    return AppArgs.model_validate({**given, **args.overrides})


def dtype_bytes(app: AppArgs, device: str) -> int:
    dtype = app.dtype if app.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs, each VALUE read as YAML (`max_num_seqs=256`, `router=pow2`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="saturated")
    ap.add_argument("--replicas", type=int, default=1, help="num_replicas: one GPU each")
    ap.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an AppArgs field (the YAML's args:), e.g. --set max_num_seqs=256",
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    ap.add_argument(
        "--run-timeout", type=float, default=900.0, help="seconds one measured run may last"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="results file: bench_serve_<name>.{md,json}")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--work-dir",
        default=None,
        help="where the model and adapters are written (default: a temporary folder)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny model, a handful of requests: checks the code",
    )
    args = ap.parse_args(argv)  # fmt: skip
    wl = (SMOKE if args.smoke else WORKLOADS)[args.workload]
    if args.num_requests is not None:
        wl = replace(wl, num_requests=args.num_requests)
    args.spec = wl
    args.overrides = parse_set(args.set)
    if args.smoke and args.device == "auto":
        args.device = "cpu"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and args.replicas > torch.cuda.device_count():
        ap.error(f"{args.replicas} replicas need as many GPUs; {torch.cuda.device_count()} seen")
    if args.name is None:
        args.name = args.workload + (f"_{args.replicas}x" if args.replicas > 1 else "")
        args.name += "_smoke" if args.smoke else ""
    return args


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    wl: Workload = args.spec
    started = time.monotonic()
    # The results name the device through torch, which opens a CUDA context here: open it (and
    # measure the ceilings) before any replica sizes its KV cache.
    device_name()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    model_dir = write_model(root, wl.model)
    spec = ModelSpec.from_dir(model_dir)
    names = adapter_names(wl.num_adapters)
    fleet = write_fleet(root, spec, names, wl.rank)
    app = app_args(args, wl, model_dir, fleet)
    ceilings = measure_ceilings(spec, args.device)
    print("ceilings", ceilings.to_json(), flush=True)

    work = streams(wl, names, args.seed, args.run_timeout)
    warm = warmup_specs(wl, names, args.replicas, args.seed)
    http = deploy_and_measure(args, app, wl, work, warm)
    roofs = {
        stream.label: roofline(
            spec,
            [s.input_len for s in stream.specs],
            [s.output_len for s in stream.specs],
            ceilings,
            app.max_num_seqs,
            dtype_bytes=dtype_bytes(app, args.device),
            replicas=args.replicas,
        )
        for stream in http.streams
    }
    meta = {
        "workload": describe(wl),
        "replicas": args.replicas,
        "app_args": app.model_dump(mode="json", exclude={"adapters"}),
        "ceilings": ceilings.to_json(),
        "roofline_formula": FORMULA,
        "roofline": {label: roof.to_json() for label, roof in roofs.items()},
        "digests": {s.label: workload_digest(s.specs) for s in http.streams},
    }
    if args.device == "cpu":
        meta["note"] = (
            "CPU: the ceilings come from a float32 product of a tiny model's shapes and a 64 MiB "
            "host copy, so the roofline is no floor here; these figures check the code only"
        )
    if http.goodput is not None:
        meta["goodput"] = goodput_json(http, Objectives())
    # Saved before the in-process run too: a run cut off there keeps the HTTP figures.
    path = report(args, wl, http, {}, roofs, meta, started)
    wait_device_free(args.device)
    local = in_process(app, model_dir, args.device, http.streams, warm)
    path = report(args, wl, http, local, roofs, meta, started)
    print(path.read_text(), flush=True)
    print(f"done in {time.monotonic() - started:.0f} s: {path}", flush=True)
    return path


def report(
    args: argparse.Namespace,
    wl: Workload,
    http: HttpPhase,
    local: Mapping[str, Measured],
    roofs: Mapping[str, Roofline],
    meta: dict[str, Any],
    started: float,
) -> Path:
    """Rows per stream (HTTP, in-process where it has run, roofline, published figures) and
    their ratios, written to the results files."""
    rows = []
    for stream in http.streams:
        rows.append(row(stream.label, "http", http.measured[stream.label]))
        if stream.label in local:
            rows.append(row(stream.label, "in-process", local[stream.label]))
        rows.append(roofline_row(stream.label, roofs[stream.label]))
        if wl.published is not None:
            source, figures = wl.published
            rows.append({"stream": stream.label, "path": f"{source} (published)", **figures})
    meta = {
        **meta,
        "ratios": ratios(rows, args.replicas, wl.published),
        "elapsed_s": time.monotonic() - started,
    }
    return save(args, wl, rows, meta)


def describe(wl: Workload) -> dict[str, Any]:
    return {
        "name": wl.name,
        "model": f"{wl.shape} shape, load_format dummy",
        "adapters": f"{'/'.join(map(str, wl.adapter_counts))} of rank {wl.rank}, {wl.slots} slots",
        "requests": wl.num_requests,
        "prompts": str(wl.input_len),
        "outputs": str(wl.output_len),
        "rate": "all at once" if math.isinf(wl.rate) else wl.rate,
        "max_num_seqs": wl.max_num_seqs,
    }


def goodput_json(http: HttpPhase, objectives: Objectives) -> dict[str, Any]:
    found = http.goodput
    return {
        "rate": found.rate,
        "bracket": list(found.bracket),
        "capacity_req_s": http.capacity_req_s,
        "objectives": {"ttft_p99_ms": objectives.ttft_p99_ms, "itl_p99_ms": objectives.itl_p99_ms},
        "points": [p.to_row() for p in found.points],
    }


COLUMNS = [
    "stream", "path", "completed", "throughput_tok_s", "ttft_p50_ms", "ttft_p90_ms",
    "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p50_s", "e2e_p90_s",
    "e2e_p99_s", "busy_share", "requests_per_replica",
]  # fmt: skip
SWEEP_COLUMNS = [
    "rate", "passed", "completed", "failed", "request_throughput", "throughput_tok_s",
    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
]  # fmt: skip


def save(args: argparse.Namespace, wl: Workload, rows: list[dict], meta: dict) -> Path:
    arrivals = "all at once" if math.isinf(wl.rate) else f"Poisson {wl.rate:g} req/s"
    if wl.sweep_steps:
        arrivals = "Poisson, goodput sweep"
    path = write_results(
        args.out,
        f"bench_serve_{args.name}",
        f"Serving, {wl.name}: {args.replicas} replica(s), {wl.num_requests} requests "
        f"({arrivals}), prompts {wl.input_len}, outputs {wl.output_len}",
        "HTTP through Serve against the engine in-process and the roofline, same requests, "
        "same run",
        COLUMNS,
        rows,
        {k: v for k, v in meta.items() if k not in ("ratios", "goodput")},
    )
    # The JSON holds everything; the markdown gets the ratios and the sweep as tables.
    data = json.loads(path.with_suffix(".json").read_text())
    data.update({k: meta[k] for k in ("ratios", "goodput") if k in meta})
    path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    append_table(path, "Ratios", ["ratio", "value"], meta["ratios"])
    if "goodput" in meta:
        g = meta["goodput"]
        low, high = g["bracket"]
        found = (
            "below every rate tried" if g["rate"] is None
            else f"at least {low:.3g} req/s" if high is None
            else f"{low:.3g} req/s (fails at {high:.3g})"
        )  # fmt: skip
        title = (
            f"Goodput sweep: {found} (TTFT P99 <= {g['objectives']['ttft_p99_ms']:g} "
            f"ms, ITL P99 <= {g['objectives']['itl_p99_ms']:g} ms; capacity "
            f"{g['capacity_req_s']:.3g} req/s)"
        )
        append_table(path, title, SWEEP_COLUMNS, g["points"])
    return path


if __name__ == "__main__":
    main()
