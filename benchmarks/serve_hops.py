"""Where a burst's requests wait on their way to the engine: each hop's start times, from a
diagnostic run's hop log (`replicas.hop_log`) and the proxy's access log.

Run the benchmark with the hop log on and access lines written at once, keep Serve's logs,
then read both:

    LORAFLEET_HOP_LOG=hops RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 \\
        python -m benchmarks.bench_serve --workload saturated --timed --replicas 2 ...
    cp -r /tmp/ray/session_latest/logs/serve serve_logs
    python -m benchmarks.serve_hops hops serve_logs --out hops.md

A request's hops, in order: `proxy` (the proxy's access line: its end less its duration, when
the proxy began the request), `ingress_asgi` (the ingress app called, before the body is
read), `ingress_handler` (the body parsed and validated), `engine_call` (tokenized, handed to
the engine deployment's router), `engine_routed` (the affinity router picked its replica),
`engine_in` (the engine replica's `generate` began),
`engine_first` (its first chunk), `ingress_first` (that chunk back in the ingress). Requests
group into bursts by their first hop (a gap over a second starts a new one); for each burst
the table gives every hop's start after the burst's first request (quantiles over its
requests) and the time between consecutive hops of one request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["HOPS", "bursts", "hop_table", "quantile", "read_hops", "read_proxy_log"]

HOPS = (
    "proxy",
    "ingress_asgi",
    "ingress_handler",
    "engine_call",
    "engine_routed",
    "engine_in",
    "engine_first",
    "ingress_first",
)
QUANTILES = (0.1, 0.5, 0.9, 1.0)

_ACCESS = re.compile(r"INFO (\S+ \S+) proxy \S+ (\S+) -- (?:POST|GET) \S+ \d+ ([\d.]+)ms")


def read_hops(paths: Iterable[Path]) -> dict[str, dict[str, float]]:
    """request id -> hop -> time (the first stamp of each hop), from hop log files or
    folders of them. Malformed lines are skipped."""
    requests: dict[str, dict[str, float]] = {}
    for path in _files(paths, "hops-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) != 3 or not parts[1]:
                continue
            try:
                when = float(parts[2])
            except ValueError:
                continue
            requests.setdefault(parts[1], {}).setdefault(parts[0], when)
    return requests


def read_proxy_log(paths: Iterable[Path]) -> dict[str, float]:
    """request id -> when the proxy began it, from Serve's proxy log files (or folders)."""
    starts: dict[str, float] = {}
    for path in _files(paths, "proxy_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _ACCESS.search(line)
            if m is None:
                continue
            end = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            starts[m.group(2)] = end - float(m.group(3)) / 1e3
    return starts


def _files(paths: Iterable[Path], pattern: str) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        out.extend(sorted(path.glob(pattern)) if path.is_dir() else [path])
    return out


def bursts(
    requests: Mapping[str, Mapping[str, float]], gap_s: float = 1.0, min_size: int = 1
) -> list[list[Mapping[str, float]]]:
    """Requests grouped by their first hop's time, a new group after a gap over `gap_s`."""
    timed = sorted((hops for hops in requests.values() if hops), key=lambda hops: _first(hops))
    groups: list[list[Mapping[str, float]]] = []
    for hops in timed:
        if groups and _first(hops) - _first(groups[-1][-1]) <= gap_s:
            groups[-1].append(hops)
        else:
            groups.append([hops])
    return [g for g in groups if len(g) >= min_size]


def _first(hops: Mapping[str, float]) -> float:
    return min(hops.values())


def quantile(xs: list[float], q: float) -> float:
    """The value at rank q of `xs` (nearest rank, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def hop_table(burst: list[Mapping[str, float]]) -> dict[str, object]:
    """One burst's figures: per hop, its start after the burst's first request at QUANTILES;
    per pair of consecutive hops seen, the time between them at P50, P90 and max."""
    t0 = min(_first(hops) for hops in burst)
    starts = {}
    for hop in HOPS:
        xs = [hops[hop] - t0 for hops in burst if hop in hops]
        if xs:
            starts[hop] = {"n": len(xs), **{f"q{q:g}": quantile(xs, q) for q in QUANTILES}}
    gaps = {}
    seen = [hop for hop in HOPS if hop in starts]
    for a, b in zip(seen, seen[1:], strict=False):
        xs = [hops[b] - hops[a] for hops in burst if a in hops and b in hops]
        if xs:
            gaps[f"{a} -> {b}"] = {
                "n": len(xs),
                "p50": quantile(xs, 0.5),
                "p90": quantile(xs, 0.9),
                "max": max(xs),
            }
    return {"requests": len(burst), "starts_s": starts, "gaps_s": gaps}


def markdown(tables: list[dict]) -> str:
    lines = []
    for i, table in enumerate(tables):
        lines += [f"### Burst {i + 1}: {table['requests']} requests", ""]
        qs = " | ".join(f"q{q:g} s" for q in QUANTILES)
        lines += [f"| hop | seen | {qs} |", "| --- | --- |" + " --- |" * len(QUANTILES)]
        for hop, row in table["starts_s"].items():
            cells = " | ".join(f"{row[f'q{q:g}']:.3f}" for q in QUANTILES)
            lines.append(f"| {hop} | {row['n']} | {cells} |")
        lines += ["", "| between | P50 s | P90 s | max s |", "| --- | --- | --- | --- |"]
        for pair, row in table["gaps_s"].items():
            lines.append(f"| {pair} | {row['p50']:.3f} | {row['p90']:.3f} | {row['max']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="hop logs and Serve log folders")
    parser.add_argument("--min-burst", type=int, default=100, help="smaller bursts left out")
    parser.add_argument("--out", type=Path, help="write the markdown here (and .json beside)")
    args = parser.parse_args(argv)
    requests = read_hops(args.paths)
    for rid, start in read_proxy_log(args.paths).items():
        if rid in requests:  # the proxy's lines of other calls (health, models) left out
            requests[rid]["proxy"] = start
    tables = [hop_table(b) for b in bursts(requests, min_size=args.min_burst)]
    text = markdown(tables)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(tables, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
