"""Sending at a load, with a fake sender in place of HTTP, on a virtual clock (the `virtual`
loop): a sleep takes no time and every timing is exactly what the code waited for, so the
sending times and durations below are checked to the nanosecond, however loaded the machine."""

from __future__ import annotations

import asyncio
import math

import pytest

from loadgen.records import Outcome, RequestRecord
from loadgen.runner import LoadConfig, run_load, warm_up
from workloads.requests import LengthRange, WorkloadConfig, build_workload


def specs(n: int):
    return build_workload(
        WorkloadConfig(
            num_prompts=n,
            input_len=LengthRange(4, 4),
            output_len=LengthRange(2, 2),
            adapters=("a", "b"),
        )
    )


class FakeSender:
    """Answers every request after `latency_s`, tracking how many are in flight."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent = 0

    async def send(self, spec, scheduled_s: float, t0: float) -> RequestRecord:
        sent_s = asyncio.get_running_loop().time() - t0
        self.sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        return RequestRecord.of(
            spec, scheduled_s, Outcome.OK, sent_s=sent_s, ttft_s=self.latency_s / 2,
            e2e_s=self.latency_s, output_tokens=spec.output_len, num_chunks=spec.output_len,
        )  # fmt: skip


class TestOpenLoop:
    def test_requests_go_out_at_their_arrival_times(self, virtual):
        load = LoadConfig(request_rate=100.0)
        result = virtual.run_until_complete(run_load(FakeSender(0.01), specs(20), load))
        scheduled = [r.scheduled_s for r in result.records]
        assert scheduled == sorted(scheduled) and scheduled[0] == 0.0
        assert [r.sent_s for r in result.records] == pytest.approx(scheduled, abs=1e-9)
        assert [r.index for r in result.records] == list(range(20))

    def test_infinite_rate_sends_everything_at_once(self, virtual):
        sender = FakeSender(0.05)
        load = LoadConfig(request_rate=math.inf)
        result = virtual.run_until_complete(run_load(sender, specs(30), load))
        assert sender.max_in_flight == 30
        assert all(r.ok for r in result.records)
        assert result.duration_s == pytest.approx(0.05)


class TestConcurrencyCap:
    def test_closed_loop_keeps_exactly_n_in_flight(self, virtual):
        sender = FakeSender(0.02)
        load = LoadConfig(request_rate=math.inf, max_concurrency=4)
        assert load.closed_loop
        result = virtual.run_until_complete(run_load(sender, specs(20), load))
        assert sender.max_in_flight == 4
        assert result.duration_s == pytest.approx(5 * 0.02)  # 20 requests over 4 lanes
        assert all(r.ok for r in result.records)

    def test_cap_holds_under_an_open_loop_too(self, virtual):
        sender = FakeSender(0.05)
        load = LoadConfig(request_rate=500.0, max_concurrency=2)
        virtual.run_until_complete(run_load(sender, specs(15), load))
        assert sender.max_in_flight == 2


class TestTotalTimeout:
    def test_running_requests_are_aborted(self, virtual):
        load = LoadConfig(timeout_s=0.2)
        result = virtual.run_until_complete(run_load(FakeSender(30.0), specs(5), load))
        assert virtual.time() == pytest.approx(0.2)  # not the senders' 30 s
        assert result.timed_out
        assert {r.outcome for r in result.records} == {Outcome.ABORTED}
        assert result.duration_s == pytest.approx(0.2)

    def test_requests_due_after_the_timeout_are_not_sent(self, virtual):
        sender = FakeSender(0.01)
        load = LoadConfig(request_rate=20.0, timeout_s=0.3)
        result = virtual.run_until_complete(run_load(sender, specs(40), load))
        outcomes = [r.outcome for r in result.records]
        assert Outcome.OK in outcomes and Outcome.NOT_SENT in outcomes
        assert sender.sent == outcomes.count(Outcome.OK) + outcomes.count(Outcome.ABORTED)
        # Arrivals are in order, so every unsent request comes after every sent one.
        first_unsent = outcomes.index(Outcome.NOT_SENT)
        assert set(outcomes[first_unsent:]) == {Outcome.NOT_SENT}


class TestWarmup:
    async def test_sends_count_requests_cycling_the_workload(self):
        sender = FakeSender(0.001)
        records = await warm_up(sender, specs(2), 5)
        assert len(records) == 5 and sender.sent == 5
        assert [r.index for r in records] == [0, 1, 0, 1, 0]

    async def test_zero_sends_nothing(self):
        sender = FakeSender(0.001)
        assert await warm_up(sender, specs(2), 0) == [] and sender.sent == 0
