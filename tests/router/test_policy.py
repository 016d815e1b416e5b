"""Routing policies as properties of their rankings: plain Python, no Ray."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import AffinityPolicy, Rendezvous, ReplicaView, Tier


def full(rid: str, queue_len: int = 10, **kw) -> ReplicaView:
    """A replica with every slot taken (so cold means evict), `queue_len` outstanding."""
    return ReplicaView(rid, free_slots=0, queue_len=queue_len, **kw)


def flat(tiers: list[list[str]]) -> list[str]:
    return [rid for tier in tiers for rid in tier]


def assert_each_replica_once(tiers: list[list[str]], replicas: list[ReplicaView]) -> None:
    ids = flat(tiers)
    assert sorted(ids) == sorted(v.replica_id for v in replicas)
    assert all(tier for tier in tiers), "no empty tiers"


def ids(n: int) -> list[str]:
    return [f"replica-{i:03d}" for i in range(n)]


class TestWhereTheAdapterIs:
    @pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
    def test_gpu_beats_loading_beats_host_beats_cold_at_equal_load(self, order):
        names = ["gpu", "host", "cold"]
        views = {
            "gpu": full("gpu", gpu=frozenset({"a"})),
            "host": full("host", host=frozenset({"a"})),
            "cold": full("cold"),
        }
        replicas = [views[names[i]] for i in order]
        assert flat(AffinityPolicy().rank("a", replicas)) == ["gpu", "host", "cold"]

        replicas.append(full("loading", loading=frozenset({"a"})))
        assert flat(AffinityPolicy().rank("a", replicas)) == ["gpu", "loading", "host", "cold"]

    def test_free_slot_beats_eviction(self):
        replicas = [full("busy"), ReplicaView("free", free_slots=1, queue_len=10)]
        assert flat(AffinityPolicy().rank("a", replicas))[0] == "free"

    def test_free_slot_beats_host_memory_that_must_evict(self):
        # One replica holds every adapter in host memory and its slots are full; the other is
        # empty. Cold adapters go where no slot is lost, whatever the hash order, while a host
        # copy into a free slot still beats a disk read.
        for adapter in (f"lora-{i}" for i in range(20)):
            replicas = [
                full("hoarder", queue_len=0, host=frozenset({adapter})),
                ReplicaView("empty", free_slots=4, queue_len=0),
            ]
            assert flat(AffinityPolicy().rank(adapter, replicas))[0] == "empty"
            replicas[0] = ReplicaView("hoarder", free_slots=1, host=frozenset({adapter}))
            assert flat(AffinityPolicy().rank(adapter, replicas))[0] == "hoarder"
        assert AffinityPolicy().tier("a", full("r", host=frozenset({"a"}))) == Tier.HOST_EVICT

    def test_own_record_marks_adapter_loading_before_the_stats_show_it(self):
        policy = AffinityPolicy()
        replicas = [full(rid) for rid in ids(8)]
        target = flat(policy.rank("a", replicas))[-1]  # the replica hashing would pick last
        policy.on_routed("a", target)
        assert policy.tier("a", full(target)) == Tier.LOADING
        assert flat(policy.rank("a", replicas))[0] == target
        policy.on_finished("a", target)
        assert policy.tier("a", full(target)) == Tier.EVICT


class TestImbalanceBound:
    def test_overloaded_replica_is_demoted_behind_all_others(self):
        replicas = [full("gpu", queue_len=100, gpu=frozenset({"a"}))]
        replicas += [full(rid, queue_len=10) for rid in ids(7)]
        ranked = flat(AffinityPolicy(imbalance_bound=1.25).rank("a", replicas))
        assert ranked[-1] == "gpu"

    def test_replica_within_the_bound_keeps_its_place(self):
        # 11 + 1 <= (77 + 1) / 8 + 8 ≈ 17.8, while 19 + 1 > (85 + 1) / 8 + 8 ≈ 18.8
        # (below a mean load of 32 the additive load_slack of 8 is the larger bound)
        replicas = [full("gpu", queue_len=11, gpu=frozenset({"a"}))]
        replicas += [full(rid, queue_len=10) for rid in ids(6)]
        replicas.append(full("other", queue_len=6))
        assert flat(AffinityPolicy(imbalance_bound=1.25).rank("a", replicas))[0] == "gpu"
        replicas[0] = full("gpu", queue_len=19, gpu=frozenset({"a"}))
        assert flat(AffinityPolicy(imbalance_bound=1.25).rank("a", replicas))[-1] == "gpu"

    def test_tiny_loads_are_not_imbalance(self):
        replicas = [full("gpu", queue_len=1, gpu=frozenset({"a"}))]
        replicas += [full(rid, queue_len=0) for rid in ids(7)]
        assert flat(AffinityPolicy().rank("a", replicas))[0] == "gpu"

    def test_rejects_a_bound_below_one(self):
        with pytest.raises(ValueError):
            AffinityPolicy(imbalance_bound=0.9)

    def test_a_few_requests_more_at_light_load_move_nothing(self):
        # 2 replicas, about 2 requests each: the one holding "a" is 5 requests busier than the
        # other, which would have to load "a". A load costs more than 5 requests of queue.
        replicas = [full("holder", queue_len=6, gpu=frozenset({"a"})), full("idle", queue_len=1)]
        assert AffinityPolicy().rank("a", replicas)[0] == ["holder"]

    def test_at_heavy_load_the_ratio_bounds_it(self):
        # Mean 45: the slack of 8 is below 25% of it, so 1.25 × mean is the bound.
        replicas = [full("holder", queue_len=60, gpu=frozenset({"a"})), full("other", queue_len=30)]
        assert flat(AffinityPolicy().rank("a", replicas)) == ["other", "holder"]


class TestColdPlacement:
    def test_two_instances_and_any_list_order_agree(self):
        replicas = [full(rid) for rid in ids(16)]
        shuffled = replicas[:]
        random.Random(7).shuffle(shuffled)
        a, b = AffinityPolicy(), AffinityPolicy()
        for k in range(200):
            adapter = f"adapter-{k}"
            assert a.rank(adapter, replicas) == b.rank(adapter, shuffled)

    def test_homes_spread_over_the_fleet(self):
        replicas = [full(rid) for rid in ids(8)]
        policy = AffinityPolicy()
        homes = Counter(flat(policy.rank(f"adapter-{k}", replicas))[0] for k in range(2000))
        assert set(homes) == {v.replica_id for v in replicas}
        assert max(homes.values()) < 1.3 * 2000 / 8

    def test_a_busier_first_hash_choice_gives_way_to_the_second(self):
        replicas = [full(rid) for rid in ids(8)]
        first, second = Rendezvous().order("cold", frozenset(ids(8)))[:2]
        # Mean (7 × 10 + 14) / 8 = 10.5: the first choice is busier than the second by more
        # than (1.25 - 1) × 10.5, yet within the bound.
        busy = [full(v.replica_id, queue_len=14) if v.replica_id == first else v for v in replicas]
        tiers = AffinityPolicy().rank("cold", busy)
        assert tiers[0] == [second] and tiers[1] == [first]
        assert_each_replica_once(tiers, busy)

    def test_a_slightly_busier_first_hash_choice_keeps_it(self):
        replicas = [full(rid) for rid in ids(8)]
        first = Rendezvous().order("cold", frozenset(ids(8)))[0]
        # 12 <= 10 + 0.25 × 10.25: not worth leaving the place every router instance agrees on.
        busy = [full(v.replica_id, queue_len=12) if v.replica_id == first else v for v in replicas]
        assert AffinityPolicy().rank("cold", busy)[0] == [first]

    def test_only_the_two_hash_choices_are_considered(self):
        # An idler third replica does not draw the adapter: routers with stale views would
        # all send their cold adapters to the same least-loaded replica.
        order = Rendezvous().order("cold", frozenset(ids(8)))
        loads = dict.fromkeys(ids(8), 10) | {order[0]: 16, order[1]: 12, order[2]: 0}
        replicas = [full(rid, queue_len=q) for rid, q in loads.items()]
        assert AffinityPolicy().rank("cold", replicas)[0] == [order[1]]

    def test_a_replica_with_a_free_slot_beats_a_home_that_must_evict(self):
        home = Rendezvous().order("cold", frozenset(ids(4)))[0]
        replicas = [
            full(rid) if rid == home else ReplicaView(rid, free_slots=1, queue_len=10)
            for rid in ids(4)
        ]
        assert home not in AffinityPolicy().rank("cold", replicas)[0]

    def test_removing_a_replica_moves_only_its_own_adapters(self):
        hrw = Rendezvous()
        before = frozenset(ids(10))
        after = before - {"replica-003"}
        for k in range(500):
            home_before = hrw.order(f"adapter-{k}", before)[0]
            home_after = hrw.order(f"adapter-{k}", after)[0]
            if home_before != "replica-003":
                assert home_after == home_before


class TestSpreading:
    # By outstanding requests alone (spread_share=None): TestSpreadByShare covers the share.

    def test_home_grows_with_demand_and_shrinks_back(self):
        policy = AffinityPolicy(spread_threshold=4, spread_share=None)
        replicas = [full(rid) for rid in ids(8)]
        assert len(policy.rank("hot", replicas)[0]) == 1
        home = policy.rank("hot", replicas)[0][0]
        for _ in range(10):
            policy.on_routed("hot", home)
        assert len(policy.rank("hot", replicas)[0]) == 3  # ceil((10 + 1) / 4)
        for _ in range(10):
            policy.on_finished("hot", home)
        assert policy.rank("hot", replicas)[0] == [home]

    def test_spread_follows_the_adapters_own_placement_order(self):
        policy = AffinityPolicy(spread_threshold=1)
        replicas = [full(rid) for rid in ids(8)]
        order = flat(policy.rank("hot", replicas))
        policy.on_routed("hot", order[0])
        policy.on_routed("hot", order[0])
        assert policy.rank("hot", replicas)[0] == order[:3]

    def test_adaptive_threshold_is_this_policys_own_load_per_replica(self):
        policy = AffinityPolicy(spread_share=None)
        replicas = [full(rid, queue_len=20) for rid in ids(8)]  # others' requests count not
        home = flat(policy.rank("hot", replicas))[0]
        for i in range(30):
            policy.on_routed(f"other-{i}", ids(8)[i % 8])
        for _ in range(18):
            policy.on_routed("hot", home)
        assert len(policy.rank("hot", replicas)[0]) == 4  # ceil(19 / max(6, 48 / 8))

    def test_an_adapter_that_is_all_a_routers_traffic_gets_every_replica(self):
        """One of several ingresses: the fleet's queues are mostly the other routers' requests,
        and this router's demand is its own part of the fleet's. Against the fleet's mean load
        (200) its 20 requests would keep the adapter on one replica."""
        policy = AffinityPolicy(spread_share=None)
        replicas = [full(rid, queue_len=200) for rid in ids(2)]
        home = flat(policy.rank("hot", replicas))[0]
        for _ in range(20):
            policy.on_routed("hot", home)
        assert sorted(policy.rank("hot", replicas)[0]) == sorted(ids(2))

    def test_a_burst_being_placed_spreads_its_adapter_before_any_placement_is_reported(self):
        """Serve reports a placement (`on_routed`) once the replica took the request: a burst
        is ranked before the first report. Its requests count from `on_placing`. Contended
        (copies stay out of the home tier) and with the adapter on both replicas, the
        burst's adapter stayed on one replica, the other taking only what the load bound
        pushed over (simulated, 2 replicas and 4 routers: 760 against 264 requests)."""
        policy = AffinityPolicy(contended_miss_share=None, spread_share=None)
        replicas = [full(rid, queue_len=0, gpu=frozenset({"a"})) for rid in ids(2)]
        assert len(policy.rank("a", replicas)[0]) == 1
        for _ in range(12):
            policy.on_placing("a")
        assert sorted(policy.rank("a", replicas)[0]) == sorted(ids(2))  # ceil(13 / 6)
        for _ in range(12):
            policy.on_placed("a")
        assert len(policy.rank("a", replicas)[0]) == 1
        policy.on_placed("a")  # more than were placing: nothing to undo
        assert policy.placing("a") == 0


class TestCopies:
    """While slots are contended, replicas that already hold the adapter take its overflow,
    never its steady traffic."""

    def setup_method(self):
        self.home, self.copy = Rendezvous().order("a", frozenset(ids(4)))[:2]

    def views(self, home_load: int, copy_load: int) -> list[ReplicaView]:
        loads = dict.fromkeys(ids(4), 10) | {self.home: home_load, self.copy: copy_load}
        holders = {self.home, self.copy}
        return [
            full(rid, queue_len=q, gpu=frozenset({"a"}) if rid in holders else frozenset())
            for rid, q in loads.items()
        ]

    def test_a_less_loaded_copy_stays_out_of_the_home_tier(self):
        # Were it in, it would take every request the home's queue is longer for, stay resident
        # and keep the adapter on two replicas after its demand fell back.
        tiers = AffinityPolicy(contended_miss_share=None).rank(
            "a", self.views(home_load=12, copy_load=9)
        )
        assert tiers[0] == [self.home]
        assert tiers[1] == [self.copy]  # the first place overflow goes
        assert_each_replica_once(tiers, self.views(12, 9))

    def test_an_overloaded_home_overflows_onto_the_copy(self):
        # bound = max(1.25 x mean, mean + 8) with the request counted: a home at 40 is over it.
        tiers = AffinityPolicy(contended_miss_share=None).rank(
            "a", self.views(home_load=40, copy_load=12)
        )
        assert tiers[0] == [self.copy]
        assert tiers[-1] == [self.home]

    def test_a_copy_is_never_a_reason_to_load_elsewhere(self):
        # Replicas without "a" never come before the holders, however idle.
        views = self.views(home_load=12, copy_load=11)
        views = [v if v.gpu else full(v.replica_id, queue_len=0) for v in views]
        assert flat(AffinityPolicy(contended_miss_share=None).rank("a", views))[:2] == [
            self.home,
            self.copy,
        ]


class TestContention:
    """Whether slots are contended is measured from the policy's own placements: the share of
    recent requests sent where their adapter was not on GPU. Uncontended, locality cannot save
    a load, so every holder shares the home tier (Ray's default: the shorter queue among the
    replicas reporting the model) and hot adapters spread at a smaller share."""

    def place(self, policy: AffinityPolicy, adapter: str, replicas: list[ReplicaView]) -> str:
        tiers = policy.rank(adapter, replicas)
        chosen = min(
            tiers[0], key=lambda rid: next(v.queue_len for v in replicas if v.replica_id == rid)
        )
        policy.on_routed(adapter, chosen)
        policy.on_finished(adapter, chosen)
        return chosen

    def test_uncontended_until_misses_show_otherwise(self):
        # A fresh fleet's slots are free; a few requests that must load make it contended.
        policy = AffinityPolicy()
        assert not policy.contended
        cold = [full(rid, queue_len=1) for rid in ids(2)]
        for i in range(8):
            self.place(policy, f"cold-{i}", cold)
        assert policy.contended
        assert AffinityPolicy(contended_miss_share=None).contended

    def test_hits_make_it_uncontended_and_misses_bring_it_back(self):
        policy = AffinityPolicy(miss_window=16)
        resident = [full(rid, queue_len=1, gpu=frozenset({"a"})) for rid in ids(2)]
        for _ in range(100):
            self.place(policy, "a", resident)
        assert policy.miss_share < 0.01 and not policy.contended
        cold = [full(rid, queue_len=1) for rid in ids(2)]
        for i in range(100):
            self.place(policy, f"cold-{i}", cold)
        assert policy.miss_share > 0.99 and policy.contended

    def test_a_request_reported_without_a_ranking_counts_nothing(self):
        policy = AffinityPolicy(miss_window=4)
        for i in range(50):
            policy.on_routed(f"a-{i}", "replica-000")
        assert policy.miss_share == 0.0

    def test_uncontended_every_holder_shares_the_home_tier(self):
        policy = AffinityPolicy(miss_window=16)
        others = frozenset(f"b-{i}" for i in range(9))
        views = [
            full(rid, queue_len=q, gpu=others | ({"a"} if q < 10 else set()))
            for rid, q in zip(ids(4), [3, 2, 10, 10], strict=True)
        ]
        contended = AffinityPolicy(contended_miss_share=None)
        assert len(contended.rank("a", views)[0]) == 1  # contended: the copy waits
        for i in range(200):  # "a" a tenth of the traffic: one home by its share
            self.place(policy, "a" if i % 10 == 0 else f"b-{i % 9}", views)
        assert not policy.contended
        assert sorted(policy.rank("a", views)[0]) == ids(2)
        assert_each_replica_once(policy.rank("a", views), views)

    def test_uncontended_a_smaller_share_spreads(self):
        # "warm" takes 30% of the traffic over 2 replicas: within spread_share (0.6 of a
        # replica's fair share), beyond uncontended_spread_share (0.4).
        names = ["warm", *(f"other-{i}" for i in range(7))]
        holding_all = [full(rid, queue_len=1, gpu=frozenset(names)) for rid in ids(2)]
        uncontended, contended = AffinityPolicy(), AffinityPolicy(contended_miss_share=None)
        for i in range(1000):
            adapter = "warm" if i % 10 < 3 else names[1 + i % 7]
            self.place(uncontended, adapter, holding_all)  # every request hits
            contended.on_routed(adapter, "replica-000")
            contended.on_finished(adapter, "replica-000")
        assert not uncontended.contended and contended.contended
        fresh = [full(rid, queue_len=1) for rid in ids(2)]  # neither holds it now
        assert len(contended.rank("warm", fresh)[0]) == 1
        assert sorted(uncontended.rank("warm", fresh)[0]) == ids(2)

    def test_bad_settings_are_refused(self):
        with pytest.raises(ValueError):
            AffinityPolicy(contended_miss_share=1.5)
        with pytest.raises(ValueError):
            AffinityPolicy(miss_window=0)


class TestSpreadByShare:
    """An adapter's recent share of the traffic sets a floor on its home's size, so the hottest
    adapters do not pile onto their hash homes at light load. Slots held contended here
    (TestContention covers the smaller share used otherwise)."""

    def route(self, policy: AffinityPolicy, adapter: str) -> None:
        # Light load: each request finishes before the next, so outstanding stays at zero.
        policy.on_routed(adapter, "replica-000")
        policy.on_finished(adapter, "replica-000")

    def test_a_hot_adapter_gets_every_replica_of_a_small_fleet(self):
        policy = AffinityPolicy(contended_miss_share=None)
        replicas = [full(rid, queue_len=1) for rid in ids(2)]
        for i in range(1000):
            self.route(policy, "hot" if i % 5 < 2 else f"cold-{i}")  # "hot": 40%
        assert policy.demand("hot") == 0
        assert policy.share("hot") == pytest.approx(0.4, abs=0.02)
        assert sorted(policy.rank("hot", replicas)[0]) == ids(2)
        assert len(policy.rank("cold-3", replicas)[0]) == 1

    def test_an_adapter_within_its_share_keeps_one_home(self):
        policy = AffinityPolicy(contended_miss_share=None)
        replicas = [full(rid, queue_len=1) for rid in ids(2)]
        for i in range(1000):
            self.route(policy, "warm" if i % 4 == 0 else f"cold-{i}")  # 25% of 2 replicas
        assert len(policy.rank("warm", replicas)[0]) == 1

    def test_the_share_fades_once_the_adapter_cools(self):
        policy = AffinityPolicy(contended_miss_share=None, share_half_life=100)
        for i in range(500):
            self.route(policy, "hot" if i % 2 else f"cold-{i}")
        hot = policy.share("hot")
        for i in range(200):
            self.route(policy, f"later-{i}")
        assert policy.share("hot") == pytest.approx(hot / 4, rel=0.05)  # two half-lives

    def test_a_few_first_requests_do_not_look_hot(self):
        policy = AffinityPolicy(contended_miss_share=None)
        for _ in range(3):
            self.route(policy, "a")
        assert policy.share("a") == pytest.approx(3 / 32, rel=0.01)  # the prior, not 100%
        replicas = [full(rid, queue_len=1) for rid in ids(2)]
        assert len(policy.rank("a", replicas)[0]) == 1

    def test_shares_survive_rescaling(self):
        # Long enough for the weights to be rescaled several times (every 40 half-lives).
        policy = AffinityPolicy(contended_miss_share=None, share_half_life=8)
        for i in range(3000):
            self.route(policy, "hot" if i % 2 else f"cold-{i % 7}")
        assert 0 < sum(policy.share(f"cold-{k}") for k in range(7)) <= 1
        assert policy.share("hot") == pytest.approx(0.5, abs=0.05)

    def test_none_spreads_by_outstanding_requests_alone(self):
        policy = AffinityPolicy(contended_miss_share=None, spread_share=None)
        replicas = [full(rid, queue_len=1) for rid in ids(2)]
        for _ in range(1000):
            self.route(policy, "hot")
        assert len(policy.rank("hot", replicas)[0]) == 1


class TestBaseModel:
    def test_none_adapter_ranks_by_load_alone(self):
        replicas = [full(rid, queue_len=q) for rid, q in zip(ids(5), [9, 3, 7, 1, 5], strict=True)]
        assert flat(AffinityPolicy().rank(None, replicas)) == [
            "replica-003",
            "replica-001",
            "replica-004",
            "replica-002",
            "replica-000",
        ]

    def test_none_adapter_requests_even_out(self):
        policy = AffinityPolicy()
        queue = dict.fromkeys(ids(6), 0)
        for _ in range(61):
            views = [full(rid, queue_len=q) for rid, q in queue.items()]
            queue[policy.rank(None, views)[0][0]] += 1
        assert max(queue.values()) - min(queue.values()) <= 1


def test_every_replica_appears_exactly_once():
    rng = random.Random(1)
    policy = AffinityPolicy()
    for trial in range(50):
        n = rng.randint(1, 20)
        replicas = [
            ReplicaView(
                rid,
                gpu=frozenset(rng.sample(["a", "b", "c", "d"], rng.randint(0, 3))),
                host=frozenset(rng.sample(["a", "b", "c", "d"], rng.randint(0, 3))),
                free_slots=rng.randint(0, 2),
                queue_len=rng.randint(0, 50),
            )
            for rid in ids(n)
        ]
        adapter = rng.choice(["a", "b", "e", None])
        tiers = policy.rank(adapter, replicas)
        assert_each_replica_once(tiers, replicas)
        policy.on_routed(adapter, tiers[0][0])
        if trial % 2:
            policy.on_finished(adapter, tiers[0][0])
