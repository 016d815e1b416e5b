"""The engine in-process on a loadgen request stream: no Ray, no HTTP, the same requests and
arrival times as `run_load` sends, and `RequestRecord`s that `loadgen.metrics.summarize` turns
into the same figures as the HTTP side.

`drive(engine, specs, offsets)` adds each request when its arrival time comes (between steps,
and while a step runs, as the served engine's inbox does), steps the engine until every request
is done, and times each token as the host sees it come out of a step. A request's clock starts
at its arrival, as an HTTP request's starts when it is sent. bench_churn drives its engine here
too, reading the engine's own request objects (queue and admission times) and adapter waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from app.protocol import HTTP_STATUS
from loadgen.records import Outcome, RequestRecord
from replicas.engine import Engine, RequestRejected
from replicas.errors import ErrorKind
from replicas.request import Request, SamplingParams
from workloads.requests import RequestSpec


@dataclass(frozen=True)
class DriveResult:
    records: list[RequestRecord]  # one per spec, in workload order
    requests: list[Request | None]  # the engine's, per spec (queue_s, admitted_at); None: not added
    adapter_waits: list[float]  # the engine's adapter_wait_s of each request that finished
    duration_s: float  # from the first arrival to the last token
    stats: tuple[dict, dict]  # EngineStats fields before and after the run

    @property
    def busy_s(self) -> float:
        """The engine's time inside steps during the run."""
        return self.stats[1]["busy_s"] - self.stats[0]["busy_s"]

    @property
    def steps(self) -> int:
        return self.stats[1]["num_steps"] - self.stats[0]["num_steps"]


@dataclass
class _Timeline:
    spec: RequestSpec
    offset: float  # arrival, seconds after the start
    stamps: list[float]  # when each output token left a step (monotonic)
    request: Request | None = None
    error: str | None = None
    status: int | None = None


def drive(engine: Engine, specs: Sequence[RequestSpec], offsets: Sequence[float]) -> DriveResult:
    """Run `specs` (their adapters by name; base-model specs without one) arriving at
    `offsets` seconds after the start, greedy, exactly `output_len` tokens each (EOS ignored)."""
    if len(specs) != len(offsets):
        raise ValueError(f"{len(specs)} specs but {len(offsets)} arrival offsets")
    order = sorted(range(len(specs)), key=lambda i: offsets[i])
    pending = [(float(offsets[i]), specs[i]) for i in order]
    timelines: dict[str, _Timeline] = {}
    waits: list[float] = []
    before = engine.stats()
    start = time.monotonic()
    next_due = 0

    def add_due() -> None:  # between steps and while one runs, as a server's inbox would
        nonlocal next_due
        now = time.monotonic() - start
        while next_due < len(pending) and pending[next_due][0] <= now:
            offset, spec = pending[next_due]
            next_due += 1
            rid = str(spec.index)
            line = timelines[rid] = _Timeline(spec, offset, [])
            if not isinstance(spec.prompt, tuple):
                line.error, line.status = "the in-process driver takes token-id prompts", 400
                continue
            params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
            adapter = None if spec.is_base else spec.model
            request = Request(rid, list(spec.prompt), params, adapter, arrival_time=start + offset)
            line.request = request
            try:
                engine.add_request(request)
            except RequestRejected as e:
                line.error, line.status = str(e), HTTP_STATUS[e.kind]

    while next_due < len(pending) or engine.has_work:
        add_due()
        if not engine.has_work:
            if next_due < len(pending):
                wait = pending[next_due][0] - (time.monotonic() - start)
                time.sleep(min(0.001, max(0.0, wait)))
            continue
        outputs = engine.step(on_idle=add_due)
        stamp = time.monotonic()  # the step's tokens are back on the host
        for out in outputs:
            line = timelines[out.request_id]
            if out.new_token_ids:
                line.stamps.extend([stamp] * len(out.new_token_ids))
            if out.metrics:
                waits.append(out.metrics["adapter_wait_s"])
            if out.error:
                line.error, line.status = (
                    out.error,
                    HTTP_STATUS[out.error_kind or ErrorKind.INTERNAL],
                )
        if engine.stalled:
            time.sleep(0.0005)
    end = max((t.stamps[-1] for t in timelines.values() if t.stamps), default=time.monotonic())
    after = engine.stats()
    return DriveResult(
        records=[_record(timelines[str(s.index)], start) for s in specs],
        requests=[timelines[str(s.index)].request for s in specs],
        adapter_waits=waits,
        duration_s=end - start,
        stats=(asdict(before), asdict(after)),
    )


def _record(line: _Timeline, start: float) -> RequestRecord:
    spec, offset = line.spec, line.offset
    if line.error is not None or not line.stamps:
        outcome = Outcome.HTTP_ERROR if line.status == 400 else Outcome.STREAM_ERROR
        error = line.error or "no tokens"
        return RequestRecord.of(spec, offset, outcome, status=line.status, error=error,
                                sent_s=offset)  # fmt: skip
    arrival = start + offset
    stamps = line.stamps
    return RequestRecord.of(
        spec,
        offset,
        Outcome.OK,
        status=200,
        sent_s=offset,
        ttft_s=stamps[0] - arrival,
        e2e_s=stamps[-1] - arrival,
        itl_s=tuple(b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)),
        output_tokens=len(stamps),
        prompt_tokens=spec.input_len,
        num_chunks=len(stamps),
    )
