"""Caller leases (replicas/leases.py) on an injected clock: whom to ask after, and when."""

from __future__ import annotations

from replicas.leases import CallerLeases


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestCallerLeases:
    def test_a_lapsed_lease_only_means_ask_again(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("a1", "ingress-a", 1.0)
        leases.track("b1", "ingress-b", 3.0)
        clock.now += 2.0
        assert leases.lapsed_callers() == ["ingress-a"]
        assert leases.owner("a1") == "ingress-a"  # asked after, its request still its own
        leases.renew("ingress-a", 1.0)  # found alive
        assert leases.lapsed_callers() == []
        clock.now += 1.0
        assert sorted(leases.lapsed_callers()) == ["ingress-a", "ingress-b"]
        assert leases.num_tracked == 2  # lapsing never drops a request

    def test_a_dead_caller_loses_its_requests_and_no_one_elses(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        for request_id, caller in (("a2", "a"), ("a1", "a"), ("b1", "b")):
            leases.track(request_id, caller, 1.0)
        clock.now += 1.0
        assert leases.abandon("a") == ["a1", "a2"]
        assert leases.abandon("a") == []  # each abandoned request is reported once
        assert leases.owner("b1") == "b" and leases.num_tracked == 1
        assert leases.lapsed_callers() == ["b"]

    def test_a_new_request_renews_its_callers_lease(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r1", "ingress", 2.0)
        clock.now += 1.5
        leases.track("r2", "ingress", 2.0)
        clock.now += 1.5
        assert leases.lapsed_callers() == []
        clock.now += 0.5
        assert leases.lapsed_callers() == ["ingress"]

    def test_only_callers_that_own_requests_are_asked_after(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r1", "busy", 1.0)
        leases.track("r2", "idle", 1.0)
        leases.release("r2")
        leases.release("r2")  # twice: harmless
        clock.now += 1.0
        assert leases.lapsed_callers() == ["busy"]
        leases.track("r3", "idle", 1.0)  # back with a new request: a new lease
        assert leases.lapsed_callers() == ["busy"]

    def test_a_renewal_never_shortens_a_lease(self):
        clock = FakeClock()
        leases = CallerLeases(clock)
        leases.track("r", "ingress", 5.0)
        leases.renew("ingress", 1.0)
        clock.now += 4.0
        assert leases.lapsed_callers() == []
