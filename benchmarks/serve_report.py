"""The benchmark's figures and results: a row per stream and path (HTTP, in-process, roofline,
published), the fleet's figures from the replicas' stats, the ratios, and the results files."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import append_table, write_results
from benchmarks.serve_goodput import Goodput, Objectives
from benchmarks.serve_roofline import Roofline
from benchmarks.serve_workloads import Workload


@dataclass
class Measured:
    """One stream's figures on one path."""

    summary: dict  # loadgen.metrics.summarize
    busy_share: list[float] = field(default_factory=list)  # per replica (one in-process)
    requests_per_replica: list[int] = field(default_factory=list)
    host_cpu: dict[str, Any] | None = None  # serve_cpu.cpu_per_token, through HTTP
    steps: dict[str, float] | None = None  # step_figures
    timeline: dict[str, Any] | None = None  # replica_timeline, through HTTP
    tcp: dict[str, int] | None = None  # serve_cpu.tcp_counters' growth over the run, through HTTP
    slowest_steps: list[dict[str, Any]] | None = None  # slowest_steps_of


def slowest_steps_of(
    answers: Sequence[Mapping[str, Any]], t0: float, count: int = 8
) -> list[dict[str, Any]]:
    """The run's `count` slowest engine steps over every replica, slowest first, from
    `EngineDeployment.slowest_steps` answers; each step's start as seconds from `t0` (the run's
    start on `time.monotonic()`, which a host's processes share), beside `slowest_ttft`."""
    steps = [
        {"replica": a["replica_id"], "at_s": round(step["started"] - t0, 3),
         **{k: v for k, v in step.items() if k != "started"}}
        for a in answers
        for step in a["steps"]
    ]  # fmt: skip
    return sorted(steps, key=lambda step: -step["step_ms"])[:count]


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


def replica_timeline(samples: list[tuple[float, str, int, int]]) -> dict[str, Any]:
    """Each replica's queue over a stream, from `(t, replica, running, waiting)` samples (t in
    seconds from the stream's start, replicas read together): when it last had work, and the
    requests it ran and held waiting on average until then. Replicas given the same requests
    that end apart lost the difference to the earlier one's idle tail; a replica running fewer
    than `max_num_seqs` with none waiting was short of requests."""
    by_replica: dict[str, list[tuple[float, int, int]]] = {}
    for t, rid, running, waiting in samples:
        by_replica.setdefault(rid, []).append((t, running, waiting))
    busy_until, mean_running, mean_waiting, starved = [], [], [], []
    for rid in sorted(by_replica):
        points = by_replica[rid]
        worked = [p for p in points if p[1] + p[2] > 0]
        end = max((p[0] for p in worked), default=0.0)
        span = [p for p in points if p[0] <= end] or points
        busy_until.append(round(end, 2))
        mean_running.append(round(sum(p[1] for p in span) / len(span), 1))
        mean_waiting.append(round(sum(p[2] for p in span) / len(span), 1))
        starved.append(round(sum(1 for p in span if p[2] == 0) / len(span), 2))
    return {
        "replica_busy_until_s": busy_until,
        "replica_mean_running": mean_running,
        "replica_mean_waiting": mean_waiting,
        # The share of samples, until its last work, in which a replica had no request waiting.
        "replica_none_waiting_share": starved,
        "samples": [[round(t, 3), rid, running, waiting] for t, rid, running, waiting in samples],
    }


def step_figures(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> dict[str, float] | None:
    """The engines' steps over a run, from `EngineStats` readings keyed by replica, before and
    after it: mean step time, of it the host's time up to the last launch, and the mean batch.
    A step slower through HTTP than in-process with the same batch is the host's doing when
    its launch time grew (the step thread waiting for the GIL among them)."""

    def grown(name: str) -> float:
        return sum(
            float(a.get(name, 0.0)) - float(before.get(rid, {}).get(name, 0.0))
            for rid, a in after.items()
        )

    steps = grown("num_steps")
    if steps <= 0:
        return None
    return {
        "step_ms": 1e3 * grown("busy_s") / steps,
        "launch_ms": 1e3 * grown("launch_s") / steps,
        "seqs_per_step": grown("step_seqs") / steps,
    }


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
    if s.get("slowest_ttft"):
        figures["slowest_ttft"] = s["slowest_ttft"]
    if m.slowest_steps:
        figures["slowest_steps"] = m.slowest_steps
    written = s.get("write_ms") or {}
    if written.get("p50") is not None:  # through HTTP: until each request was on the wire
        figures["write_p50_ms"], figures["write_p99_ms"] = written["p50"], written["p99"]
    if m.tcp:
        figures["tcp_counters"] = m.tcp
    figures["busy_share"] = (
        sum(m.busy_share) / len(m.busy_share) if m.busy_share else None
    )  # the replicas' mean
    figures["requests_per_replica"] = m.requests_per_replica or None
    figures["busy_share_per_replica"] = m.busy_share or None
    if m.timeline is not None:
        figures.update({k: v for k, v in m.timeline.items() if k != "samples"})
        figures["replica_samples"] = m.timeline["samples"]
        # The stream's end after the last replica ran out of work: tokens still on their way
        # through the ingress and the proxy (to within a sampling round).
        ends = m.timeline["replica_busy_until_s"]
        figures["delivery_tail_s"] = round(s["duration_s"] - max(ends), 2) if ends else None
    figures.update(m.steps or {})
    if m.host_cpu is not None:
        figures["host_cpu_us_per_token"] = m.host_cpu["us_per_token"]
        figures["host_cpu_us_per_token_by_process"] = m.host_cpu.get("us_per_token_by_process")
        figures["host_cpu_threads_s"] = m.host_cpu.get("threads_cpu_s")
        figures["load_generator_cores"] = m.host_cpu.get("load_generator_cores")
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


def goodput_json(found: Goodput, capacity_req_s: float | None, objectives: Objectives) -> dict:
    return {
        "rate": found.rate,
        "bracket": list(found.bracket),
        "capacity_req_s": capacity_req_s,
        "objectives": {"ttft_p99_ms": objectives.ttft_p99_ms, "itl_p99_ms": objectives.itl_p99_ms},
        "points": [p.to_row() for p in found.points],
    }


COLUMNS = [
    "stream", "path", "completed", "throughput_tok_s", "ttft_p50_ms", "ttft_p90_ms",
    "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p50_s", "e2e_p90_s",
    "e2e_p99_s", "busy_share", "step_ms", "launch_ms", "seqs_per_step", "requests_per_replica",
    "replica_busy_until_s", "replica_mean_running", "delivery_tail_s",
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
    cpu = [
        {"stream": r["stream"], "process": role, "us_per_token": value}
        for r in rows
        if r.get("host_cpu_us_per_token")
        for role, value in r["host_cpu_us_per_token"].items()
    ]
    if cpu:
        title = "Host CPU per delivered token through HTTP (µs from /proc, by role)"
        append_table(path, title, ["stream", "process", "us_per_token"], cpu)
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
