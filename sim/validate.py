"""Predicted against measured: the simulator on the cells of a real Serve run.

    python -m sim.validate --measured benchmarks/results/router_serve_2x_64a_r16_s8_skewed.json
    python -m sim.validate --measured X.json --calibration benchmarks/results/sim_calibration.json

Reads the JSON that benchmarks/bench_router_serve.py writes (its `args` and one row per
popularity and router), rebuilds each cell's workload with the same loadgen calls and seed
(`sim.workload.serving_benchmark`), simulates every router of the file on a fleet of the same
shape, and prints per cell the measured and predicted adapter loads and disk reads per 1k
requests, the mean wait for an adapter, imbalance and TTFT P50 and P99, each with its check:
the prediction within `--tolerance` (20%) of the measurement. `loads_vs_pow2` is the figure the
simulator exists for: each router's loads over pow2's. The runs went through HTTP, so the
predictions carry what the served path adds, measured (`sim.cells.served_path`: time on every
TTFT and on every engine step) unless `--in-process` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sim.calibration import DEFAULT, Calibration
from sim.cells import IN_PROCESS, SERVED_PATH_RUN, RouterCell, ServedPath, served_path
from sim.cells import predict as predict_cell
from sim.fleet import ROUTERS

DEFAULT_CALIBRATION = Path("benchmarks/results/sim_calibration.json")
FIGURES = (
    "loads_per_1k", "disk_reads_per_1k", "adapter_wait_mean_ms", "imbalance", "ttft_p50_ms",
    "ttft_p99_ms", "itl_p50_ms", "loads_vs_pow2",
)  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One measured row: a router on a popularity, with the run's shape."""

    popularity: str
    router: str
    measured: Mapping[str, float | None]


@dataclass(frozen=True)
class RunShape:
    replicas: int
    num_adapters: int
    slots: int
    host_cache: int
    rate: float
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_num_seqs: int
    max_model_len: int
    seed: int
    rank: int = 16

    def cell(self, popularity: str) -> RouterCell:
        return RouterCell(name="measured", popularity=popularity, **asdict(self))


def _range(text: Any) -> tuple[int, int]:
    low, _, high = str(text).partition(":")
    return int(low), int(high or low)


def parse_measured(data: Mapping[str, Any]) -> tuple[RunShape, list[Cell]]:
    """The run's shape and its rows from a bench_router_serve results JSON (its `args` are
    stored as strings). Raises ValueError when the file is not one."""
    try:
        args = data["args"]
        slots = int(args["slots"])
        host = args.get("host_cache")
        shape = RunShape(
            replicas=int(args["replicas"]),
            num_adapters=int(args["num_adapters"]),
            slots=slots,
            # bench_router_serve: max(host_cache, slots); no host_cache: every adapter
            host_cache=max(
                int(host) if host not in (None, "None") else int(args["num_adapters"]), slots
            ),
            rate=float(args["rate"]),
            num_requests=int(args["num_requests"]),
            input_len=_range(args["input_len"]),
            output_len=_range(args["output_len"]),
            max_num_seqs=int(args.get("max_num_seqs", 64)),
            max_model_len=int(args.get("max_model_len") or 2048),
            seed=int(args.get("seed", 0)),
            rank=int(args.get("rank", 16)),
        )
        cells = [Cell(row["popularity"], row["router"], row) for row in data["rows"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a bench_router_serve results file: {e!r}") from None
    unknown = {c.router for c in cells} - set(ROUTERS)
    if unknown:
        raise ValueError(f"routers the simulator does not model: {sorted(unknown)}")
    return shape, cells


def predict(
    shape: RunShape,
    popularity: str,
    routers: Sequence[str],
    cal: Calibration,
    *,
    seeds: int = 3,
    served: ServedPath = IN_PROCESS,
) -> dict[str, dict[str, float]]:
    """Per router, the simulated figures, each the mean over `seeds` simulator seeds (the
    workload stays the measured run's)."""
    out = predict_cell(shape.cell(popularity), cal, routers, seeds=seeds, served=served)
    if "pow2" in out:
        for figures in out.values():
            base = out["pow2"]["loads_per_1k"]
            figures["loads_vs_pow2"] = figures["loads_per_1k"] / base if base else math.nan
    return out


def within(predicted: float | None, measured: float | None, tolerance: float) -> bool | None:
    """|predicted - measured| <= tolerance x measured; None when either is missing."""
    if predicted is None or measured is None or math.isnan(predicted) or math.isnan(measured):
        return None
    return abs(predicted - measured) <= tolerance * abs(measured)


def compare(
    cells: Sequence[Cell],
    predicted: Mapping[tuple[str, str], Mapping[str, float]],
    tolerance: float = 0.2,
) -> list[dict[str, Any]]:
    """One row per cell: each figure measured, predicted and whether it is within tolerance."""
    pow2 = [c for c in cells if c.router == "pow2"]
    measured_pow2 = {c.popularity: c.measured.get("loads_per_1k") for c in pow2}
    rows = []
    for cell in cells:
        m = dict(cell.measured)
        base = measured_pow2.get(cell.popularity)
        loads = m.get("loads_per_1k")
        if m.get("loads_vs_pow2") is None and base and loads is not None:
            m["loads_vs_pow2"] = loads / base
        p = predicted[cell.popularity, cell.router]
        row: dict[str, Any] = {"popularity": cell.popularity, "router": cell.router}
        for name in FIGURES:
            row[f"{name}_measured"] = m.get(name)
            row[f"{name}_predicted"] = p.get(name)
            row[f"{name}_ok"] = within(p.get(name), m.get(name), tolerance)
        rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, Any]], tolerance: float) -> str:
    head = ["popularity", "router"]
    for name in FIGURES:
        head += [f"{name} meas", "pred", f"±{tolerance:.0%}"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["popularity"], row["router"]]
        for name in FIGURES:
            ok = row[f"{name}_ok"]
            cells += [
                _fmt(row[f"{name}_measured"]),
                _fmt(row[f"{name}_predicted"]),
                "n/a" if ok is None else ("yes" if ok else "NO"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    checks = [row[f"{n}_ok"] for row in rows for n in FIGURES if row[f"{n}_ok"] is not None]
    lines += ["", f"{sum(checks)} of {len(checks)} predictions within {tolerance:.0%}"]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", required=True, help="bench_router_serve results JSON")
    ap.add_argument(
        "--calibration",
        default=None,
        help=f"sim.calibrate's JSON (default: {DEFAULT_CALIBRATION} if present, else the "
        "built-in H100 estimate)",
    )
    ap.add_argument("--seeds", type=int, default=3, help="simulator seeds averaged per cell")
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument(
        "--in-process",
        action="store_true",
        help=f"leave out what HTTP and Serve add (default: measured, {SERVED_PATH_RUN.name})",
    )
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    shape, cells = parse_measured(json.loads(Path(args.measured).read_text()))
    path = args.calibration or (DEFAULT_CALIBRATION if DEFAULT_CALIBRATION.exists() else None)
    cal = Calibration.load(path) if path else DEFAULT
    routers = list(dict.fromkeys(c.router for c in cells))
    if "pow2" not in routers:
        routers.append("pow2")  # loads_vs_pow2 needs it
    served = IN_PROCESS if args.in_process else served_path(cal=cal)
    predicted = {}
    for popularity in dict.fromkeys(c.popularity for c in cells):
        figures = predict(shape, popularity, routers, cal, seeds=args.seeds, served=served)
        for router, values in figures.items():
            predicted[popularity, router] = values
    rows = compare(cells, predicted, args.tolerance)
    print(f"measured: {args.measured}")
    print(f"calibration: {path or 'built-in estimate'} {cal.source}")
    print(
        f"served path: {served.overhead_s * 1e3:.1f} ms on every TTFT (HTTP, proxy, ingress), "
        f"{served.step_s * 1e3:.2f} ms more an engine step"
    )
    print(table(rows, args.tolerance))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
