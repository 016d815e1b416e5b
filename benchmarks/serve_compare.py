"""Two `bench_serve` runs of one machine side by side: a baseline (HTTP and in-process) and a
variant (often `--http-only`, e.g. `--set engine_process=true`), each variant's HTTP figures
against the baseline's in-process ones and against its HTTP ones.

    python -m benchmarks.serve_compare --name engine_process \\
        --pair results/bench_serve_saturated_thread.json:results/bench_serve_saturated_process.json

Each `--pair BASELINE:VARIANT` is two result JSONs made one after the other on one machine
(`benchmarks/device_suite.sh serve-process`); rows are by stream (32 adapters, 1 adapter).
Writes `bench_serve_compare_<name>.{md,json}`.

Scale-out instead: `--scale ONE.json,TWO.json,FOUR.json` (one replica first, then runs with
more, each with the same requests a replica: `device_suite.sh serve-scale`) puts each HTTP
tok/s against N times the one replica's, with how evenly the requests were spread (the most a
replica got over the mean).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import write_results

FIGURES = ("throughput_tok_s", "ttft_p50_ms", "itl_p50_ms", "step_ms", "launch_ms")
COLUMNS = [
    "pair", "stream", "in-process tok/s", "baseline HTTP tok/s", "variant HTTP tok/s",
    "variant HTTP / in-process", "baseline HTTP / in-process", "variant / baseline HTTP",
    "TTFT P50 ms (baseline)", "ITL P50 ms (baseline)", "launch ms (baseline, in-process)",
    "CPU µs/token (baseline)",
]  # fmt: skip


def rows_by(result: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    return {r["stream"]: r for r in result["rows"] if r["path"] == path}


def compare(index: int, baseline: dict[str, Any], variant: dict[str, Any]) -> list[dict]:
    """One row a stream that both runs have through HTTP."""
    out = []
    base_http, local = rows_by(baseline, "http"), rows_by(baseline, "in-process")
    for stream, run in rows_by(variant, "http").items():
        if stream not in base_http:
            continue
        base = base_http[stream]
        own = local.get(stream)
        tok = run["throughput_tok_s"]
        cpu = (run.get("host_cpu_us_per_token") or {}).get("serving processes")
        base_cpu = (base.get("host_cpu_us_per_token") or {}).get("serving processes")
        out.append(
            {
                "pair": index,
                "stream": stream,
                "in-process tok/s": own["throughput_tok_s"] if own else None,
                "baseline HTTP tok/s": base["throughput_tok_s"],
                "variant HTTP tok/s": tok,
                "variant HTTP / in-process": tok / own["throughput_tok_s"] if own else None,
                "baseline HTTP / in-process": (
                    base["throughput_tok_s"] / own["throughput_tok_s"] if own else None
                ),
                "variant / baseline HTTP": tok / base["throughput_tok_s"],
                "TTFT P50 ms (baseline)": f"{run['ttft_p50_ms']:.1f} ({base['ttft_p50_ms']:.1f})",
                "ITL P50 ms (baseline)": f"{run['itl_p50_ms']:.2f} ({base['itl_p50_ms']:.2f})",
                "launch ms (baseline, in-process)": (
                    f"{run['launch_ms']:.2f} ({base['launch_ms']:.2f}, {own['launch_ms']:.2f})"
                    if own and run.get("launch_ms") is not None
                    else None
                ),
                "CPU µs/token (baseline)": (
                    f"{cpu:.0f} ({base_cpu:.0f})" if cpu is not None and base_cpu else None
                ),
                "figures": {k: run.get(k) for k in FIGURES},
            }
        )
    return out


SCALE_COLUMNS = [
    "replicas", "stream", "HTTP tok/s", "one replica's HTTP tok/s", "HTTP / (N x one)",
    "requests_per_replica", "imbalance", "busy_share", "replica_busy_until_s",
    "delivery_tail_s", "load generator cores", "commit",
]  # fmt: skip


def imbalance(requests_per_replica: list[int] | None) -> float | None:
    """The most requests a replica got over the mean (1.0: perfectly even)."""
    if not requests_per_replica or not sum(requests_per_replica):
        return None
    return max(requests_per_replica) * len(requests_per_replica) / sum(requests_per_replica)


def scale_rows(runs: list[dict[str, Any]]) -> list[dict]:
    """One row a stream of each run, against the first run's (one replica's) HTTP tok/s."""
    one = rows_by(runs[0], "http")
    out = []
    for run in runs:
        n = run["replicas"]
        for stream, row in rows_by(run, "http").items():
            if stream not in one:
                continue
            base = one[stream]["throughput_tok_s"]
            out.append(
                {
                    "replicas": n,
                    "stream": stream,
                    "HTTP tok/s": row["throughput_tok_s"],
                    "one replica's HTTP tok/s": base,
                    "HTTP / (N x one)": row["throughput_tok_s"] / (n * base),
                    "requests_per_replica": row.get("requests_per_replica"),
                    "imbalance": imbalance(row.get("requests_per_replica")),
                    "busy_share": row.get("busy_share"),
                    # when each replica ran out of work, and how long the stream ran on
                    # (runs from before bench_serve sampled the replicas' queues have none)
                    "replica_busy_until_s": row.get("replica_busy_until_s"),
                    "delivery_tail_s": row.get("delivery_tail_s"),
                    "load generator cores": row.get("load_generator_cores"),
                    "commit": run.get("commit"),
                }
            )
    return out


def scale(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    runs = [json.loads(Path(p).read_text()) for p in args.scale.split(",")]
    if runs[0].get("replicas") != 1:
        parser.error("--scale starts with the one-replica run")
    per_replica = {_requests_a_replica(r) for r in runs}
    if len(per_replica) != 1:
        parser.error("--scale runs must send the same requests a replica")
    return write_results(
        args.out,
        f"bench_serve_scale_{args.name}",
        f"Serving: {args.name}, scale-out over engine replicas",
        "each run's HTTP tok/s against N times the one-replica run's, same requests a replica, "
        "runs one after the other on one machine",
        SCALE_COLUMNS,
        scale_rows(runs),
        {
            "measured_on": sorted({r["device"] for r in runs}),
            "runs": [{k: r.get(k) for k in ("command", "commit", "date")} for r in runs],
        },
    )


def _requests_a_replica(run: dict[str, Any]) -> float:
    return run["workload"]["requests"] / run["replicas"]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", help="BASELINE:VARIANT")
    parser.add_argument("--scale", help="ONE.json,TWO.json,...: the one-replica run first")
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if (args.pair is None) == (args.scale is None):
        parser.error("give --pair (one or more) or --scale")
    if args.scale is not None:
        return scale(parser, args)
    rows: list[dict] = []
    pairs = []
    devices = set()
    for index, pair in enumerate(args.pair, 1):
        base_path, sep, variant_path = pair.partition(":")
        if not sep:
            parser.error(f"--pair wants BASELINE:VARIANT, got {pair!r}")
        baseline = json.loads(Path(base_path).read_text())
        variant = json.loads(Path(variant_path).read_text())
        if baseline.get("digests") != variant.get("digests"):
            parser.error(f"pair {index} did not send the same requests (their digests differ)")
        devices |= {baseline["device"], variant["device"]}
        pairs.append(
            {
                "pair": index,
                "baseline": {k: baseline.get(k) for k in ("command", "commit", "date")},
                "variant": {k: variant.get(k) for k in ("command", "commit", "date")},
            }
        )
        rows += compare(index, baseline, variant)
    if not rows:
        parser.error("no stream is in both runs through HTTP")
    return write_results(
        args.out,
        f"bench_serve_compare_{args.name}",
        f"Serving: {args.name}, a variant against its baseline run on the same machine",
        "variant HTTP tok/s against the baseline's in-process and HTTP tok/s, same requests "
        "(the workload's digests), runs one after the other on one machine",
        COLUMNS,
        rows,
        {"measured_on": sorted(devices), "pairs": pairs},
    )


if __name__ == "__main__":
    print(main())
