"""One benchmark: warm up, then the workload at each load, with the server's adapter stats read
around every run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from loadgen.metrics import SLO, per_adapter, summarize
from loadgen.progress import make_progress
from loadgen.records import RequestRecord
from loadgen.runner import LoadConfig, LoadResult, Sender, run_load, warm_up
from loadgen.server_stats import numeric_diff
from workloads.requests import RequestSpec


class Server(Sender, Protocol):
    async def adapter_stats(self) -> dict[str, Any] | None:
        """The server's adapter stats, or None where it has none."""
        ...


class WarmupFailed(RuntimeError):
    """Every warm-up request failed: the server is down, or the workload is wrong for it."""


@dataclass(frozen=True)
class RunReport:
    """The workload at one load."""

    result: LoadResult
    summary: dict
    per_adapter: dict[str, dict]
    adapter_stats: dict | None  # {"before", "after", "diff"}; None without GET /v1/adapters

    @property
    def load(self) -> LoadConfig:
        return self.result.load


@dataclass(frozen=True)
class BenchmarkResult:
    runs: list[RunReport]
    warmup: list[RequestRecord]


async def run_benchmark(
    server: Server,
    specs: list[RequestSpec],
    loads: list[LoadConfig],
    *,
    warmup: int = 0,
    slo: SLO | None = None,
    progress: bool = True,
) -> BenchmarkResult:
    """Warm up once with `warmup` requests, then run `specs` at each of `loads` in turn.
    Raises `WarmupFailed` when every warm-up request failed."""
    warmup_records = await warm_up(server, specs, warmup)
    if warmup_records and not any(r.ok for r in warmup_records):
        first = warmup_records[0]
        raise WarmupFailed(
            f"all {len(warmup_records)} warm-up requests failed; the first: "
            f"{first.outcome.value} (status {first.status}): {first.error}"
        )
    runs = []
    for load in loads:
        before = await server.adapter_stats()
        bar = make_progress(len(specs), _label(load, len(loads)), enabled=progress)
        try:
            result = await run_load(server, specs, load, bar)
        finally:
            bar.close()
        after = await server.adapter_stats() if before is not None else None
        stats = None
        if before is not None and after is not None:
            stats = {"before": before, "after": after, "diff": numeric_diff(before, after)}
        runs.append(
            RunReport(
                result=result,
                summary={
                    **summarize(result.records, result.duration_s, slo or SLO()),
                    "timed_out": result.timed_out,
                },
                per_adapter=per_adapter(result.records),
                adapter_stats=stats,
            )
        )
    return BenchmarkResult(runs=runs, warmup=warmup_records)


def _label(load: LoadConfig, num_loads: int) -> str:
    if num_loads == 1:
        return ""
    return f"rate {load.request_rate:g} "
