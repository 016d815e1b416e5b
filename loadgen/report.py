"""The results as JSON (everything), a short markdown report, and a PNG of a rate sweep."""

from __future__ import annotations

import datetime
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadgen.benchmark import BenchmarkResult, RunReport
from loadgen.metrics import SLO
from workloads.requests import WorkloadConfig

SCHEMA = "lorafleet.loadgen/1"
MAX_ADAPTER_ROWS = 20
# The markdown table's columns, one row per run: header -> (load, summary) -> cell
RUN_COLUMNS: dict[str, Callable[[dict, dict], Any]] = {
    "rate": lambda load, s: load["request_rate"],
    "burstiness": lambda load, s: load["burstiness"],
    "max conc.": lambda load, s: load["max_concurrency"] or "-",
    "ok": lambda load, s: s["completed"],
    "failed": lambda load, s: s["failed"],
    "req/s": lambda load, s: s["request_throughput"],
    "out tok/s": lambda load, s: s["output_token_throughput"],
    "TTFT P50": lambda load, s: s["ttft_ms"]["p50"],
    "TTFT P99": lambda load, s: s["ttft_ms"]["p99"],
    "ITL P50": lambda load, s: s["itl_ms"]["p50"],
    "ITL P99": lambda load, s: s["itl_ms"]["p99"],
    "TPOT P50": lambda load, s: s["tpot_ms"]["p50"],
    "E2E P50": lambda load, s: s["e2e_ms"]["p50"],
}


def to_json(
    result: BenchmarkResult,
    *,
    base_url: str,
    endpoint: str,
    workload: WorkloadConfig,
    digest: str,
    slo: SLO,
    command: str,
    models: list[str] | None = None,
    client_options: dict[str, Any] | None = None,
    save_requests: bool = False,
) -> dict[str, Any]:
    """Everything about the benchmark; per-request records only with `save_requests`."""
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "client_host": platform.node(),
        "server": {"base_url": base_url, "endpoint": endpoint, "models": models},
        "client": client_options or {},
        "workload": {**workload.to_json(), "digest": digest},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "warmup": {
            "requests": len(result.warmup),
            "failed": sum(not r.ok for r in result.warmup),
        },
        "runs": [_run_json(run, save_requests) for run in result.runs],
    }


def _run_json(run: RunReport, save_requests: bool) -> dict[str, Any]:
    out = {
        "load": run.load.to_json(),
        "summary": run.summary,
        "per_adapter": run.per_adapter,
        "adapter_stats": run.adapter_stats,
    }
    if save_requests:
        out["requests"] = [r.to_json() for r in run.result.records]
    return out


def to_markdown(report: dict[str, Any]) -> str:
    """A title, the command and workload, one row per run, and the per-adapter table when there
    is a single run. Takes the dict `to_json` made."""
    w = report["workload"]
    server = report["server"]
    runs = report["runs"]
    with_goodput = report["slo"]["ttft_ms"] is not None or report["slo"]["tpot_ms"] is not None
    lines = [
        f"# Load test: {server['base_url']} ({server['endpoint']})",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- workload: {_describe_workload(w)}",
    ]
    columns = dict(RUN_COLUMNS)
    if with_goodput:
        slo = report["slo"]
        lines.append(f"- SLO: TTFT <= {slo['ttft_ms']} ms, TPOT <= {slo['tpot_ms']} ms")
        columns["goodput req/s"] = lambda load, s: s["goodput"]
    lines += ["", "Latencies in ms.", "", _row(list(columns)), "|" + " --- |" * len(columns)]
    for run in runs:
        lines.append(_row([cell(run["load"], run["summary"]) for cell in columns.values()]))
    for run in runs:
        for e in run["summary"]["errors"][:3]:
            rate = run["load"]["request_rate"]
            lines.append(f"\n- rate {rate}: {e['count']} x status {e['status']}: {e['error']}")
        if run["summary"]["timed_out"]:
            lines.append(f"\n- rate {run['load']['request_rate']}: stopped at the total timeout")
    if len(runs) == 1:
        lines += _adapter_table(runs[0])
    return "\n".join(lines) + "\n"


def _adapter_table(run: dict[str, Any]) -> list[str]:
    rows = list(run["per_adapter"].items())
    lines = ["", "| model | requests | failed | TTFT P50 ms | E2E P50 ms |", "|" + " --- |" * 5]
    for model, a in rows[:MAX_ADAPTER_ROWS]:
        name = f"{model} (base)" if a["is_base"] else model
        lines.append(_row([name, a["count"], a["failed"], a["ttft_p50_ms"], a["e2e_p50_ms"]]))
    if len(rows) > MAX_ADAPTER_ROWS:
        lines.append(f"\n{len(rows) - MAX_ADAPTER_ROWS} more models in the JSON.")
    changes = _flatten(run["adapter_stats"]["diff"]) if run["adapter_stats"] else []
    if changes:
        shown = ", ".join(f"{k} {v:+g}" for k, v in changes[:10])
        more = f" and {len(changes) - 10} more" if len(changes) > 10 else ""
        lines += ["", f"/v1/adapters numbers that changed over the run: {shown}{more}"]
    return lines


def _describe_workload(w: dict[str, Any]) -> str:
    n = len(w["adapters"])
    law = {"skewed": f"skewed alpha={w['alpha']}", "zipf": f"zipf s={w['zipf_s']}"}
    adapters = f"{n} adapters ({law.get(w['popularity'], w['popularity'])})" if n else "no adapters"
    unit = "tokens" if w["prompt_kind"] == "tokens" else "words"
    return (
        f"{w['num_prompts']} prompts, input {w['input_len']} {unit}, output {w['output_len']} "
        f"tokens, {adapters}, base fraction {w['base_fraction']:g}, seed {w['seed']}, "
        f"digest {w['digest'][:12]}"
    )


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(_fmt(c) for c in cells) + " |"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, float]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flatten(v, f"{prefix}{i}.")]
    return [] if tree is None else [(prefix.rstrip("."), tree)]


def write_plot(report: dict[str, Any], path: str | Path) -> Path | None:
    """TTFT and ITL (P50, P99) and throughput against the request rate, as a PNG. Returns None,
    with a message on stderr, when matplotlib is not installed (`pip install -e '.[bench]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    runs = report["runs"]
    rates = [run["load"]["request_rate"] for run in runs]
    numeric = all(isinstance(r, int | float) and math.isfinite(r) for r in rates)
    x = rates if numeric else list(range(len(rates)))

    def series(metric: str, stat: str) -> list[float]:
        return [_nan(run["summary"][metric][stat]) for run in runs]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, series(metric, stat), style, label=stat.upper())
        ax.set_title(f"{title} (ms)")
        ax.set_ylabel("ms")
        ax.legend()
    ax = axes[2]
    ax.plot(
        x, [_nan(r["summary"]["output_token_throughput"]) for r in runs], "o-", label="output tok/s"
    )
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    twin = ax.twinx()
    twin.plot(
        x,
        [_nan(r["summary"]["request_throughput"]) for r in runs],
        "s--",
        color="C1",
        label="req/s",
    )
    twin.set_ylabel("requests/s")
    ax.legend(loc="upper left")
    twin.legend(loc="lower right")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        if not numeric:
            ax.set_xticks(x, [r if isinstance(r, str) else f"{r:g}" for r in rates])
    fig.suptitle(f"{report['server']['base_url']} ({report['server']['endpoint']})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan(v: float | None) -> float:
    return math.nan if v is None else v
