"""The serving benchmark: the real app through HTTP, the engine in-process and the hardware's
floor, on the same request stream, in one run.

    python -m benchmarks.bench_serve --workload saturated            # one GPU
    python -m benchmarks.bench_serve --workload poisson              # goodput sweep
    python -m benchmarks.bench_serve --workload seeds                # beside SGLang's figures
    python -m benchmarks.bench_serve --workload saturated --replicas 2
    python -m benchmarks.bench_serve --smoke                         # CPU, tiny model, ~1 min

A run measures the device's ceilings (`serve_roofline.measure_ceilings`), deploys the app from
`AppArgs` as `serve run` would (`--set KEY=VALUE` changes any field) and streams every request
through HTTP (`serve_http`), then shuts Serve down and drives the engine in-process on the
identical requests and arrival times (`serve_engine.drive`), and sets both against the
workload's roofline (`serve_roofline`). docs/perf/serving.md has what each step measures, the
workloads (`serve_workloads`), the ratios and the results files (`serve_report`):
benchmarks/results/bench_serve_<workload>[_<N>x][_timed][_smoke].{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from app.config import AppArgs
from benchmarks.bench_router_serve import add_run_options
from benchmarks.common import device_name
from benchmarks.serve_engine import drive
from benchmarks.serve_goodput import Objectives
from benchmarks.serve_http import HttpPhase, deploy_and_measure
from benchmarks.serve_report import (
    Measured,
    goodput_json,
    ratios,
    roofline_row,
    row,
    save,
    slowest_steps_of,
    step_figures,
)
from benchmarks.serve_roofline import FORMULA, Roofline, measure_ceilings, roofline
from benchmarks.serve_workloads import (
    BASE_MODEL,
    SMOKE,
    WORKLOADS,
    Stream,
    Workload,
    describe,
    streams,
    warmup_specs,
)
from loadgen import LengthRange, RequestSpec, summarize
from replicas.models.spec import ModelSpec
from synthetic.adapters import write_fleet
from synthetic.models import write_model
from synthetic.presets import TINY
from workloads.requests import workload_digest
from workloads.router_cell import adapter_names

# The H200 step calibration `python -m sim.calibrate` measured (Llama-3-8B shapes, rank 16).
CALIBRATION = Path(__file__).parent / "results" / "sim_calibration.json"
# --host-share by default: steps sleep. docs/perf/serving.md says what a share held as bytecode
# does to the served path and why it overstates a GPU engine's launches.
HOST_SHARE = 0.0
TINY_DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")  # fmt: skip


def in_process(
    app: AppArgs, model_dir: Path, device: str, work: list[Stream], warm: list[RequestSpec]
) -> dict[str, Measured]:
    from replicas.engine import Engine
    from replicas.engine_calls import slowest_steps

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
            since, t0 = engine.num_steps, time.monotonic()
            result = drive(engine, stream.specs, stream.offsets().tolist())
            summary = summarize(result.records, result.duration_s)
            busy = [result.busy_s / result.duration_s] if result.duration_s > 0 else []
            steps = step_figures({"engine": result.stats[0]}, {"engine": result.stats[1]})
            slow = [{"replica_id": "in-process", "steps": slowest_steps(engine, since)}]
            out[stream.label] = Measured(
                summary, busy, [summary["completed"]], steps=steps,
                slowest_steps=slowest_steps_of(slow, t0),
            )  # fmt: skip
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


def timed(wl: Workload) -> Workload:
    """The workload for timed steps: the same requests, adapters and vocabulary, with hidden
    sizes so small that adapter weights cost nothing on CPU (the steps' time comes from the
    calibration, not from these shapes)."""
    small = {k: TINY[k] for k in TINY_DIMS}
    return replace(wl, model={**wl.model, **small}, shape=f"{wl.shape}, timed steps")


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
        "--output-len",
        default=None,
        metavar="N or LO:HI",
        help="override the workload's output lengths (e.g. 16: per-request costs show)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an AppArgs field (the YAML's args:), e.g. --set max_num_seqs=256",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="py-spy samples each serving process during one stream (collapsed stacks)",
    )
    ap.add_argument(
        "--profile-stream",
        type=int,
        default=0,
        metavar="K",
        help="which stream --profile samples: 0 the first (e.g. 32 adapters), 1 the next",
    )
    ap.add_argument(
        "--profile-s",
        type=float,
        default=15.0,
        metavar="S",
        help="how long --profile samples from the stream's start (e.g. 3: a burst's ramp)",
    )
    ap.add_argument(
        "--http-only", action="store_true", help="skip the in-process run (profiling the path)"
    )
    ap.add_argument(
        "--timed",
        nargs="?",
        const=str(CALIBRATION),
        default=None,
        metavar="CALIBRATION",
        help="no GPU: the engine's steps take the calibrated GPU time (sim.calibrate's JSON, "
        f"default {CALIBRATION}) with the workload's shapes made tiny, on CPU",
    )
    ap.add_argument(
        "--host-share",
        type=float,
        default=HOST_SHARE,
        metavar="F",
        help="with --timed: the share of each step spent running Python before it sleeps, "
        "holding the GIL as launches do (default 0: steps only sleep; 0.29 is an H200 engine's "
        "launch share in-process, 5.64 of 19.2 ms a step at 123 sequences)",
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=None,
        metavar="K",
        help="load generator processes sending the HTTP requests (default: one an engine "
        "replica); one process reads about a core's worth of streams",
    )
    add_run_options(ap, "bench_serve", 900.0, "CPU, tiny model, a handful of requests")
    args = ap.parse_args(argv)  # fmt: skip
    if args.clients is None:
        args.clients = args.replicas
    if args.clients < 1:
        ap.error("--clients must be at least 1")
    wl = (SMOKE if args.smoke else WORKLOADS)[args.workload]
    if args.num_requests is not None:
        wl = replace(wl, num_requests=args.num_requests)
    if args.output_len is not None:
        try:
            wl = replace(wl, output_len=LengthRange.parse(args.output_len))
        except ValueError as e:
            ap.error(f"--output-len: {e}")
    args.overrides = parse_set(args.set)
    if not 0.0 <= args.host_share <= 1.0:
        ap.error("--host-share is a share of a step, in [0, 1]")
    if args.timed is not None:
        wl = timed(wl)
    args.spec = wl
    on_cpu = args.smoke or args.timed is not None or not torch.cuda.is_available()
    args.device = "cpu" if on_cpu else "cuda"
    if args.device == "cuda" and args.replicas > torch.cuda.device_count():
        ap.error(f"{args.replicas} replicas need as many GPUs; {torch.cuda.device_count()} seen")
    if args.name is None:
        args.name = args.workload + (f"_{args.replicas}x" if args.replicas > 1 else "")
        args.name += "_timed" if args.timed is not None else ""
        args.name += "_smoke" if args.smoke else ""
    return args


def timed_calibration(args: argparse.Namespace, root: Path) -> Path:
    """The calibration the timed engine reads: --timed's, with --host-share in its step."""
    data = json.loads(Path(args.timed).read_text())
    data["step"] = {**data["step"], "host_share": args.host_share}
    path = root / "timed_steps.json"
    path.write_text(json.dumps(data))
    return path


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
    if args.timed is not None:
        args.overrides.setdefault("timed_steps", str(timed_calibration(args, root)))
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
        "load_generator_processes": args.clients,
        "app_args": app.model_dump(mode="json", exclude={"adapters"}),
        "ceilings": ceilings.to_json(),
        "roofline_formula": FORMULA,
        "roofline": {label: roof.to_json() for label, roof in roofs.items()},
        "digests": {s.label: workload_digest(s.specs) for s in http.streams},
    }
    if args.timed is not None:
        meta["note"] = (
            "timed steps: every engine step takes the time the calibration's GPU took for it "
            "and runs no model; everything else (Serve, proxy, ingress, engine replica, "
            "scheduler, adapter manager) is real and on this CPU. The roofline is no floor here"
        )
        meta["calibration"] = json.loads(Path(args.timed).read_text()).get("source", {})
        meta["host_share"] = args.host_share
    elif args.device == "cpu":
        meta["note"] = (
            "CPU: the ceilings come from a float32 product of a tiny model's shapes and a 64 MiB "
            "host copy, so the roofline is no floor here; these figures check the code only"
        )
    if http.goodput is not None:
        meta["goodput"] = goodput_json(http.goodput, http.capacity_req_s, Objectives())
    # Saved before the in-process run too: a run cut off there keeps the HTTP figures.
    path = report(args, wl, http, {}, roofs, meta, started)
    if args.http_only:
        return path
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
    if http.idle_cores is not None:
        meta["idle_cores"] = http.idle_cores  # serve_http.idle_cores: the roles at rest
    return save(args, wl, rows, meta)


if __name__ == "__main__":
    main()
