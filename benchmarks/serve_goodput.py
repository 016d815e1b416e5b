"""Goodput: the highest Poisson request rate at which the server still meets its latency
objectives (TTFT P99 and ITL P99), found by a short bisection over rates.

`search(measure, low, high, steps)` calls `measure(rate)` (one short run at that rate, returning
loadgen's `summarize` figures) first at `high`, then at `low`, then `steps` times at the
geometric mean of the highest passing and lowest failing rate. A rate passes when every request
completed and both P99s are within the objectives. The answer is the highest passing rate seen,
with the bracket it lies in: `high` passing means the goodput is at least `high`; `low` failing
means it is below `low` (no rate found).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Objectives:
    ttft_p99_ms: float = 1000.0
    itl_p99_ms: float = 100.0

    def met_by(self, summary: dict) -> bool:
        ttft, itl = summary["ttft_ms"]["p99"], summary["itl_ms"]["p99"]
        return (
            summary["failed"] == 0
            and ttft is not None
            and ttft <= self.ttft_p99_ms
            and (itl is None or itl <= self.itl_p99_ms)  # one-token outputs have no ITL
        )


@dataclass(frozen=True)
class Point:
    rate: float
    passed: bool
    summary: dict

    def to_row(self) -> dict:
        s = self.summary
        return {
            "rate": self.rate,
            "passed": self.passed,
            "completed": s["completed"],
            "failed": s["failed"],
            "request_throughput": s["request_throughput"],
            "throughput_tok_s": s["output_token_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["p50"],
            "itl_p99_ms": s["itl_ms"]["p99"],
        }


@dataclass(frozen=True)
class Goodput:
    rate: float | None  # the highest passing rate; None when even `low` failed
    bracket: tuple[float, float | None]  # goodput in [low, high); high None: above every rate
    points: list[Point]  # in the order measured


async def search(
    measure: Callable[[float], Awaitable[dict]],
    low: float,
    high: float,
    steps: int,
    objectives: Objectives | None = None,
) -> Goodput:
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low}, {high}")
    objectives = objectives or Objectives()
    points: list[Point] = []

    async def probe(rate: float) -> bool:
        summary = await measure(rate)
        points.append(Point(rate, objectives.met_by(summary), summary))
        return points[-1].passed

    if await probe(high):
        return Goodput(high, (high, None), points)
    if not await probe(low):
        return Goodput(None, (0.0, low), points)
    passing, failing = low, high
    for _ in range(steps):
        rate = math.sqrt(passing * failing)
        if await probe(rate):
            passing = rate
        else:
            failing = rate
    return Goodput(passing, (passing, failing), points)
