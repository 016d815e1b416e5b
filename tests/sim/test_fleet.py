"""Routing policies as properties of a simulated fleet: the real scheduler, slot pool and
prefetch queue per replica, Ray Serve's routing rules, the real affinity router. Small fleets
on a virtual clock, so each run takes well under a second."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sim.calibration import Calibration, StepCost
from sim.cells import calibration
from sim.fleet import Fleet, FleetConfig, FleetEvent
from sim.replica import ReplicaConfig, capacity_rps
from sim.workload import Arrival, Generated, Workload

# A slow device (40 ms steps) and short outputs: few steps per simulated second, so each run
# is cheap; what is tested is the routing, which scales with them.
CAL = Calibration(
    step=StepCost(base_s=0.04, per_seq_s=0.001, per_adapter_s=0.001, prefill_token_s=1e-4),
    copy_s=0.005,
    read_s=0.05,
    adapter_bytes=80 * 2**20,
)
SMALL = ReplicaConfig(max_num_seqs=8, max_loras_per_batch=4, max_loaded_loras=16)
PROMPT, OUTPUT = (64, 128), (8, 16)
CAPACITY = capacity_rps(CAL, SMALL, sum(PROMPT) / 2, sum(OUTPUT) / 2)  # one replica, req/s


def stream(rng: random.Random, t0: float, t1: float, rate: float, adapters: list[str]):
    """Poisson arrivals at `rate` from t0 to t1, each for one of `adapters` at random."""
    out, t = [], t0
    while (t := t + rng.expovariate(rate)) < t1:
        out.append(Arrival(t, rng.choice(adapters), rng.randint(*PROMPT), rng.randint(*OUTPUT)))
    return out


def workload(*parts: list[Arrival]) -> Workload:
    return Workload((), tuple(sorted((a for p in parts for a in p), key=lambda a: a.t)), None)


def run(router: str, w: Workload, replicas: int = 2, events=(), **policy) -> Fleet:
    config = FleetConfig(
        num_replicas=replicas,
        router=router,
        replica=SMALL,
        policy_kwargs=tuple(sorted(policy.items())),
    )
    fleet = Fleet(config, w, CAL, events)
    fleet.result = fleet.run()
    return fleet


def served(fleet: Fleet, t0: float, t1: float, adapter: str | None = None) -> Counter:
    """Requests sent between t0 and t1 (for `adapter`, if given) per replica that served them."""
    return Counter(
        r.replica_id
        for r in fleet.requests
        if t0 <= r.created_at < t1 and not r.failed and adapter in (None, r.adapter)
    )


def imbalance(counts: Counter, replicas: int) -> float:
    return max(counts.values()) / (sum(counts.values()) / replicas)


class TestHotAdapter:
    """One adapter carrying 1.5x what one replica serves, then a fifth of that, beside
    background adapters that all fit the slots (uncontended) or need twice the fleet's slots
    once the hot adapter cools (contended)."""

    def fleet(self, background_adapters: int) -> Fleet:
        rng = random.Random(0)
        background = [f"bg-{i}" for i in range(background_adapters)]
        w = workload(
            stream(rng, 0, 20, 1.5 * CAPACITY, ["hot"]),
            stream(rng, 20, 60, 0.15 * CAPACITY, ["hot"]),
            stream(rng, 0, 20, 0.2 * CAPACITY, background[:3]),
            stream(rng, 20, 60, 0.6 * CAPACITY, background),
        )
        # A short memory of the traffic shares (default 1,024 requests) so the fall shows within
        # the run; the rule that narrows the home is the same.
        return run("affinity", w, share_half_life=64)

    @pytest.fixture(scope="class")
    def contended(self) -> Fleet:
        return self.fleet(16)

    @pytest.fixture(scope="class")
    def uncontended(self) -> Fleet:
        return self.fleet(3)

    def test_is_served_by_both_replicas_with_bounded_imbalance(self, contended):
        hot = served(contended, 5, 20, "hot")
        assert len(hot) == 2 and min(hot.values()) > 0.3 * sum(hot.values())
        assert imbalance(served(contended, 5, 20), 2) <= 1.25

    def test_stops_spreading_when_its_load_falls_back_and_slots_are_needed(self, contended):
        assert contended.routers[0].choice.routing.policy.contended
        hot = served(contended, 45, 60, "hot")
        # Its home takes it again; the copy only what an overloaded home overflows (one
        # request of 22 here, against 124 of 263 while it was spread).
        assert sum(hot.values()) - max(hot.values()) <= 0.1 * sum(hot.values()), hot

    def test_keeps_using_both_copies_while_slots_are_not_needed(self, uncontended):
        # Every adapter fits: the copy costs nothing, and both replicas take the hot adapter's
        # requests by queue length, as Ray's default router does with two holders.
        assert not uncontended.routers[0].choice.routing.policy.contended
        hot = served(uncontended, 45, 60, "hot")
        assert len(hot) == 2, hot
        assert imbalance(served(uncontended, 25, 60), 2) <= 1.25

    def test_nothing_is_lost(self, contended, uncontended):
        for fleet in (contended, uncontended):
            assert fleet.result.completed == fleet.result.sent
            assert fleet.result.failed == 0


def test_bursts_keep_the_load_bounded():
    # Four phases, each a Zipf over a fresh ranking, the rate alternating 0.6x and 1.4x of 70%
    # of the fleet's capacity: the hot set moves and arrives in bursts. At these queue lengths
    # (a few requests) the policy's bound is its additive slack, not the 1.25 ratio: Ray's
    # default measures 1.22 on the same stream.
    w = Generated(
        "bursty", 1.0, num_adapters=24, num_requests=900, rate=0.7 * 4 * CAPACITY,
        prompt=PROMPT, output=OUTPUT, burst=0.4, seed=3,
    ).build()  # fmt: skip
    result = run("affinity", w, replicas=4).result
    assert result.completed == result.sent
    assert result.imbalance <= 1.35


def test_unpopular_adapters_are_not_starved():
    # A geometric popularity over 40 adapters, 4 slots each: the tail's requests must load
    # their adapter behind a steady stream for the head.
    w = Generated(
        "skewed", 0.8, num_adapters=40, num_requests=800, rate=0.75 * 2 * CAPACITY,
        prompt=PROMPT, output=OUTPUT, seed=5,
    ).build()  # fmt: skip
    fleet = run("affinity", w)
    counts = Counter(a.adapter for a in w.measured)
    rare = {a for a, n in counts.items() if n <= 5}
    assert len(rare) >= 5
    rare_ttft = [r.ttft_s for r in fleet.requests if r.adapter in rare and r.measured]
    all_ttft = sorted(r.ttft_s for r in fleet.requests if r.measured)
    assert fleet.result.completed == fleet.result.sent
    # No rare adapter's request waits more than a few times the slowest 1% of everyone.
    assert max(rare_ttft) <= 3 * all_ttft[int(0.99 * len(all_ttft))]


class TestReplicaDies:
    @pytest.fixture(scope="class")
    def fleet(self) -> Fleet:
        rng = random.Random(7)
        w = workload(stream(rng, 0, 20, 2.4 * CAPACITY, [f"a-{i}" for i in range(8)]))
        return run("affinity", w, replicas=3, events=[FleetEvent(8.0, "kill", 1)])

    def test_only_requests_on_it_fail(self, fleet):
        failed = [r for r in fleet.requests if r.failed]
        assert failed and all(r.replica_id == "replica-001" for r in failed)
        assert all(r.created_at < 8.0 for r in failed)
        assert fleet.result.completed + fleet.result.failed == fleet.result.sent

    def test_later_requests_go_to_the_survivors(self, fleet):
        after = served(fleet, 8.5, 20)
        assert set(after) == {"replica-000", "replica-002"}
        assert imbalance(after, 2) <= 1.25


class TestReplicaJoins:
    def fleet(self, router: str) -> Fleet:
        rng = random.Random(8)
        w = workload(stream(rng, 0, 30, 1.4 * CAPACITY, [f"a-{i}" for i in range(6)]))
        return run(router, w, replicas=2, events=[FleetEvent(10.0, "add")])

    def test_affinity_gives_the_new_replica_a_share(self):
        fleet = self.fleet("affinity")
        assert served(fleet, 0, 10)["replica-002"] == 0
        after = served(fleet, 15, 30)
        assert after["replica-002"] >= 0.1 * sum(after.values())
        assert fleet.result.completed == fleet.result.sent

    def test_pow2_leaves_it_idle_while_the_others_hold_every_adapter(self):
        # MultiplexMixin offers only the replicas reporting the model id while one of them
        # has room under max_ongoing_requests: a replica that joins holding nothing gets no
        # request for an adapter that is resident elsewhere.
        fleet = self.fleet("pow2")
        assert served(fleet, 15, 30)["replica-002"] == 0
        assert fleet.result.completed == fleet.result.sent


def test_same_seed_same_result():
    w = Generated("zipf", 1.0, num_adapters=16, num_requests=300, rate=2 * CAPACITY,
                  prompt=PROMPT, output=OUTPUT).build()  # fmt: skip
    a, b = run("pow2", w).result.as_dict(), run("pow2", w).result.as_dict()
    assert a == b


def test_a_burst_of_one_adapter_after_a_mixed_one_is_spread():
    """The serving benchmark's saturated sequence (bench_serve): a burst over 32 adapters,
    then one of a single adapter, all at once, 2 replicas and the 4 routers of 4 ingresses.
    Each router ranks its whole burst before the first placement is reported; counting only
    reported placements, the single adapter stayed on one replica for most of it (760
    against 264 requests, imbalance 1.48). Counting the requests being placed, 400/624: each
    router then balanced against cached lengths that still held what the first burst left
    (`QueueLengthFeed.reported` replaces them)."""
    rng = random.Random(0)
    names = [f"ad{i}" for i in range(32)]
    warm = [Arrival(0.0, names[i % 32], rng.randint(128, 512), 8) for i in range(256)]
    mixed = [Arrival(0.0, rng.choice(names), rng.randint(128, 512), 128) for _ in range(1024)]
    single = tuple(Arrival(0.0, "ad0", rng.randint(128, 512), 128) for _ in range(1024))
    config = FleetConfig(
        num_replicas=2,
        num_routers=4,
        replica=ReplicaConfig(max_num_seqs=128, max_loras_per_batch=32, max_loaded_loras=32),
    )
    h200 = calibration()  # the engine's own step times: the test's slow device queues far more
    result = Fleet(config, Workload(tuple(warm + mixed), single), h200).run()
    assert result.completed == result.sent == 1024
    assert result.imbalance <= 1.1
