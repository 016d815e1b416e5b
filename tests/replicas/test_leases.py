"""Caller leases (replicas/leases.py) on an injected clock."""

from __future__ import annotations

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

    def test_lapsed_callers_keep_their_requests_until_expired(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r1", "a", 1.0)
        leases.track("r2", "b", 3.0)
        clock.now += 2.0
        assert leases.lapsed_callers() == ["a"]
        assert leases.owner("r1") == "a"  # asked after, not yet abandoned
        leases.renew("a", 1.0)  # found alive
        assert leases.lapsed_callers() == [] and leases.expired() == []

    def test_only_lapsed_callers_that_own_requests_are_asked_after(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r1", "busy", 1.0)
        leases.track("r2", "idle", 1.0)
        leases.release("r2")
        clock.now += 1.0
        assert leases.lapsed_callers() == ["busy"]
        assert leases.expired() == ["r1"]  # and the idle caller's lease is forgotten
        assert leases.lapsed_callers() == []
