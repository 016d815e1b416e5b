"""Sending a workload at a load: open-loop arrivals, optionally capped in-flight, bounded in
time.

`rate` inf with `max_concurrency` N is a closed loop: N requests in flight, each completion
sending the next. With a finite rate as well, requests whose send time has come wait for a free
slot, and their clock (TTFT, E2E) starts when they are sent, as in sglang's bench_serving.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Protocol

from loadgen.progress import NoProgress, Progress
from loadgen.records import Outcome, RequestRecord
from workloads.arrivals import arrival_offsets
from workloads.requests import RequestSpec, rng_for


class Sender(Protocol):
    async def send(self, spec: RequestSpec, scheduled_s: float, t0: float) -> RequestRecord:
        """Send now and return the record, timed from `t0`; never raises for a failed request."""
        ...


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # Gamma shape of the gaps; 1: Poisson
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    timeout_s: float = 3600.0  # the whole run; requests still running then are aborted
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.request_rate) and self.max_concurrency is not None

    def to_json(self) -> dict:
        return {
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "closed_loop": self.closed_loop,
            "timeout_s": self.timeout_s,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class LoadResult:
    load: LoadConfig
    records: list[RequestRecord]  # one per spec, in workload order
    duration_s: float  # from the first send to the last completion (or the timeout)
    timed_out: bool


async def run_load(
    sender: Sender,
    specs: list[RequestSpec],
    load: LoadConfig,
    progress: Progress | None = None,
) -> LoadResult:
    """Send every spec at its arrival time and wait for all of them, at most `load.timeout_s`.
    At the timeout, running requests are cancelled (`ABORTED`) and unsent ones `NOT_SENT`."""
    progress = progress or NoProgress()
    offsets = arrival_offsets(
        len(specs), load.request_rate, load.burstiness, rng_for(load.seed, "arrivals")
    ).tolist()
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    tasks: dict[int, asyncio.Task[RequestRecord]] = {}
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, offset: float) -> RequestRecord:
        if slots is None:
            record = await sender.send(spec, offset, t0)
        else:
            async with slots:
                record = await sender.send(spec, offset, t0)
        progress.update(record)
        return record

    async def dispatch() -> None:
        for spec, offset in zip(specs, offsets, strict=True):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks[spec.index] = asyncio.create_task(one(spec, offset))
        if tasks:
            await asyncio.wait(tasks.values())

    timed_out = False
    try:
        await asyncio.wait_for(dispatch(), load.timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    duration_s = time.perf_counter() - t0
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)

    records = []
    for spec, offset in zip(specs, offsets, strict=True):
        task = tasks.get(spec.index)
        if task is None:
            record = RequestRecord.unfinished(spec, offset, Outcome.NOT_SENT)
        elif task.cancelled():
            record = RequestRecord.unfinished(spec, offset, Outcome.ABORTED)
        else:
            record = task.result()  # a bug in the sender surfaces here
        records.append(record)
    return LoadResult(load=load, records=records, duration_s=duration_s, timed_out=timed_out)


async def warm_up(sender: Sender, specs: list[RequestSpec], count: int) -> list[RequestRecord]:
    """Send `count` requests (the first specs, cycled) all at once and wait for them; their
    records are for a sanity check, never for the figures."""
    if count <= 0 or not specs:
        return []
    t0 = time.perf_counter()
    chosen = [specs[i % len(specs)] for i in range(count)]
    return list(await asyncio.gather(*(sender.send(s, 0.0, t0) for s in chosen)))
