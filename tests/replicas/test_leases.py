"""Caller leases (replicas/leases.py) on an injected clock, and the ingress side that renews
them (app/fleet.py: LeaseKeeper) with a fake renewal call."""

from __future__ import annotations

import asyncio

from app.fleet import LeaseKeeper
from replicas.leases import CallerLeases


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestCallerLeases:
    def test_a_caller_that_stops_renewing_loses_its_requests_and_no_one_elses(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("a1", "ingress-a", 2.0)
        leases.track("a2", "ingress-a", 2.0)
        leases.track("b1", "ingress-b", 2.0)
        for _ in range(6):  # b renews every 0.5 s, a has died
            clock.now += 0.5
            leases.renew("ingress-b", 2.0)
            if clock.now < 102.0:
                assert leases.expired() == []
        assert clock.now == 103.0
        assert leases.expired() == ["a1", "a2"]
        assert leases.expired() == []  # each abandoned request is reported once
        assert leases.owner("b1") == "ingress-b" and leases.num_tracked == 1

    def test_a_new_request_renews_its_callers_lease(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r1", "ingress", 2.0)
        clock.now += 1.5
        leases.track("r2", "ingress", 2.0)
        clock.now += 1.5
        assert leases.expired() == []
        clock.now += 0.5
        assert leases.expired() == ["r1", "r2"]

    def test_released_requests_are_not_aborted(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("done", "ingress", 1.0)
        leases.track("running", "ingress", 1.0)
        leases.release("done")
        leases.release("done")  # twice: harmless
        clock.now += 1.0
        assert leases.expired() == ["running"]
        assert leases.num_tracked == 0

    def test_a_renewal_never_shortens_a_lease(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r", "ingress", 5.0)
        leases.renew("ingress", 1.0)
        clock.now += 4.0
        assert leases.expired() == []

    def test_a_caller_back_after_its_lease_lapsed_starts_a_new_one(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("old", "ingress", 1.0)
        clock.now += 2.0
        assert leases.expired() == ["old"]
        leases.renew("ingress", 1.0)
        leases.track("new", "ingress", 1.0)
        clock.now += 0.5
        assert leases.expired() == []
        assert leases.owner("new") == "ingress"


class TestLeaseKeeper:
    async def test_renews_only_while_requests_are_in_flight(self):
        calls: list[tuple[str, float]] = []

        async def renew(caller_id: str, lease_s: float) -> None:
            calls.append((caller_id, lease_s))

        keeper = LeaseKeeper(renew, renew_s=0.01, lease_s=0.05, caller_id="me")
        keeper.hold()
        keeper.hold()
        await asyncio.sleep(0.1)
        assert len(calls) >= 3 and set(calls) == {("me", 0.05)}
        keeper.release()
        await asyncio.sleep(0.03)
        assert len(calls) >= 5  # one request still holds the lease
        keeper.release()
        await asyncio.sleep(0.03)
        idle = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == idle  # idle: no renewals
        keeper.hold()
        await asyncio.sleep(0.05)
        assert len(calls) > idle  # renewing again
        keeper.release()

    async def test_a_failing_or_hanging_renewal_does_not_stop_the_next(self):
        attempts = 0

        async def renew(caller_id: str, lease_s: float) -> None:
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                raise RuntimeError("engine unreachable")
            if attempts == 2:
                await asyncio.sleep(10)  # cut off after renew_s

        keeper = LeaseKeeper(renew, renew_s=0.01)
        keeper.hold()
        await asyncio.sleep(0.12)
        keeper.release()
        assert attempts >= 4
