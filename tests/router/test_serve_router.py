"""The Serve side of the affinity router without a cluster: fake replicas that look like
`RunningReplica` (an id and `routing_stats`), a fake hint board, and the real `RequestRouter`
subclass driven through its hooks."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from replicas.protocol import GenerateRequest
from replicas.request import SamplingParams
from router.hints import HintBoard, HintDebouncer, HintSender, follow_hints
from router.policy import AffinityPolicy, ReplicaView
from router.queue_lengths import ANSWER_FRESH_S, IN_TRANSIT_S
from router.routing import PLACING_S
from router.serve_router import (
    AffinityRequestRouter,
    AffinityRouting,
    Pow2Router,
    replica_view,
    request_tokens,
)


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    """What the router reads of a `RunningReplica`."""

    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> FakeId:
        return FakeId(self.name)


@dataclass
class ProbedReplica(FakeReplica):
    """A replica Serve's own selection can probe: `get_queue_len` answers `answer`, or never
    (None), as a replica whose probes all miss their deadline."""

    answer: int | None = None
    max_ongoing_requests: int = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        if self.answer is None:
            await asyncio.Event().wait()
        return self.answer


class BrokenStats(FakeReplica):
    @property
    def routing_stats(self) -> dict[str, Any]:
        raise RuntimeError("no stats yet")

    @routing_stats.setter
    def routing_stats(self, value) -> None:
        pass


def stats(gpu=(), loading=(), host=(), num_slots=2, free_slots=None, waiting=0, running=0):
    return {
        "gpu": list(gpu),
        "loading": list(loading),
        "host": list(host),
        "num_slots": num_slots,
        "free_slots": num_slots - len(gpu) - len(loading) if free_slots is None else free_slots,
        "num_waiting": waiting,
        "num_running": running,
    }


class FakeRef:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return asyncio.sleep(0).__await__()


class FakeBoard:
    """An actor handle's shape: `board.post.remote(...)` records the call."""

    def __init__(self, error: Exception | None = None) -> None:
        self.posts: list[tuple[str, str, float]] = []
        self.error = error
        board = self

        class _Post:
            @staticmethod
            def remote(replica_id, adapter, eta_s):
                board.posts.append((replica_id, adapter, eta_s))
                return FakeRef(board.error)

        self.post = _Post


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds. The deadline only turns a hang into a failure: what is
    waited for is bound to happen (a lookup on a worker thread, a task's next turn)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def ready_sender(board, clock=None, interval_s=0.5) -> HintSender:
    sender = HintSender(lambda: board, interval_s=interval_s, clock=clock or Clock())
    sender.send("warmup", "nobody")  # starts the lookup, drops this hint
    await until(lambda: sender.board is not None)
    assert sender.board is board
    return sender


class TestReplicaView:
    def test_stats_become_the_view(self):
        view = replica_view(
            "r1",
            stats(gpu=["a"], loading=["b"], host=["c", "d"], num_slots=4, waiting=3, running=2),
            tokens_in_flight=40,
        )
        assert view == ReplicaView(
            "r1",
            frozenset({"a"}),
            frozenset({"b"}),
            frozenset({"c", "d"}),
            num_slots=4,
            free_slots=2,
            queue_len=5,
            tokens_in_flight=40,
        )

    def test_the_router_queue_length_wins_over_the_engine_counts(self):
        view = replica_view("r1", stats(waiting=9, running=9), queue_len=3)
        assert view.queue_len == 3

    @pytest.mark.parametrize("reported", [None, {}, {"gpu": "oops", "num_slots": -1}, [1, 2]])
    def test_missing_or_malformed_stats_read_as_an_empty_replica(self, reported):
        view = replica_view("r1", reported, default_num_slots=4)
        assert (view.gpu, view.loading, view.host) == (frozenset(),) * 3
        assert view.num_slots == view.free_slots == 4
        assert view.queue_len == 0

    def test_free_slots_never_exceed_the_slots(self):
        assert replica_view("r1", {"num_slots": 2, "free_slots": 7}).free_slots == 2

    def test_request_tokens_are_prompt_plus_budget(self):
        class Pending:
            args = [GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=5), "a")]

        class Other:
            args = ["not a generate request"]

        assert request_tokens(Pending()) == 8
        assert request_tokens(Other()) == 0
        assert request_tokens(None) == 0


class TestRanking:
    def test_tiers_are_lists_of_the_given_replicas(self):
        replicas = [FakeReplica(f"r{i}", stats()) for i in range(4)]
        routing = AffinityRouting(AffinityPolicy())
        tiers = routing.rank("a", replicas)
        assert all(isinstance(tier, list) and tier for tier in tiers)
        flat = [r for tier in tiers for r in tier]
        assert all(any(r is c for c in replicas) for r in flat)
        assert sorted(r.name for r in flat) == sorted(r.name for r in replicas)

    def test_the_replica_holding_the_adapter_comes_first(self):
        replicas = [
            FakeReplica("r0", stats(gpu=["x"])),
            FakeReplica("r1", stats(gpu=["a"])),
            FakeReplica("r2", stats(host=["a"])),
        ]
        tiers = AffinityRouting(AffinityPolicy()).rank("a", replicas)
        assert tiers[0] == [replicas[1]]

    def test_a_replica_without_stats_is_still_routable(self):
        replicas = [BrokenStats("new"), FakeReplica("old", {})]
        tiers = AffinityRouting(AffinityPolicy()).rank("a", replicas)
        assert sorted(r.name for tier in tiers for r in tier) == ["new", "old"]

    def test_a_policy_that_names_nobody_falls_back_to_all(self):
        class Silent(AffinityPolicy):
            def rank(self, adapter, replicas):
                return [["ghost"]]

        replicas = [FakeReplica("r0"), FakeReplica("r1")]
        assert AffinityRouting(Silent()).rank("a", replicas) == [replicas]

    def test_no_replicas_no_tiers(self):
        assert AffinityRouting(AffinityPolicy()).rank("a", []) == []

    def test_the_base_model_goes_to_the_least_loaded(self):
        replicas = [FakeReplica("r0", stats(running=5)), FakeReplica("r1", stats(running=0))]
        tiers = AffinityRouting(AffinityPolicy()).rank(None, replicas)
        assert tiers[0] == [replicas[1]]


class TestAccounting:
    def test_routed_requests_count_until_they_finish(self):
        routing = AffinityRouting(AffinityPolicy())
        routing.routed("q1", "a", "r1", 10)
        routing.routed("q2", "a", "r1", 5)
        assert routing.tokens_in_flight("r1") == 15
        assert routing.policy.demand("a") == 2
        routing.finished("q1", "r1")
        routing.finished("q1", "r1")  # twice: counted once
        assert routing.tokens_in_flight("r1") == 5
        assert routing.policy.demand("a") == 1
        routing.finished("q2", "r1")
        assert routing.tokens_in_flight("r1") == 0 and routing.policy.demand("a") == 0

    def test_completions_of_rejected_attempts_are_ignored(self):
        routing = AffinityRouting(AffinityPolicy())
        routing.finished("never-routed", "r1")
        routing.routed("q1", "a", "r2", 4)
        routing.finished("q1", "r1")  # an earlier attempt on r1 was turned away
        assert routing.tokens_in_flight("r2") == 4 and routing.policy.demand("a") == 1

    def test_own_placements_steer_the_next_request_before_stats_show_them(self):
        replicas = [FakeReplica(f"r{i}", stats()) for i in range(3)]
        routing = AffinityRouting(AffinityPolicy())
        first = routing.rank("a", replicas)[0][0]
        routing.routed("q1", "a", first.name, 8)
        for replica in replicas:
            replica.routing_stats = stats()  # still stale: nothing resident anywhere
        assert routing.rank("a", replicas)[0][0] is first

    def test_tokens_in_flight_reach_the_view(self):
        routing = AffinityRouting(AffinityPolicy())
        routing.routed("q1", None, "r1", 30)
        [view] = routing.views([FakeReplica("r1", stats())])
        assert view.tokens_in_flight == 30


class TestPlacing:
    """Requests ranked and not yet routed count in their adapter's demand (`on_placing`)."""

    def test_a_ranked_request_counts_once_until_it_is_routed_or_finished(self):
        routing = AffinityRouting(AffinityPolicy(), clock=Clock())
        replicas = [FakeReplica("r0", stats(gpu=["a"])), FakeReplica("r1", stats(gpu=["a"]))]
        for i in range(5):
            routing.rank("a", replicas, request_id=f"q{i}")
        routing.rank("a", replicas, request_id="q0")  # ranked again: a retry, not a request
        routing.rank("a", replicas)  # no id: not counted
        assert routing.policy.placing("a") == 5
        routing.routed("q0", "a", "r0", tokens=8)
        assert routing.policy.placing("a") == 4 and routing.policy.demand("a") == 1
        routing.finished("q1", "r1")  # ended without a replica (rejected, failed)
        assert routing.policy.placing("a") == 3
        routing.rank("a", replicas, request_id="q0")  # routed already: not placing again
        assert routing.policy.placing("a") == 3

    def test_one_ranked_long_ago_stops_counting(self):
        clock = Clock()
        routing = AffinityRouting(AffinityPolicy(), clock=clock)
        replicas = [FakeReplica("r0", stats())]
        routing.rank("a", replicas, request_id="old")
        clock.now += PLACING_S + 1
        routing.rank("b", replicas, request_id="new")
        assert routing.policy.placing("a") == 0 and routing.policy.placing("b") == 1
        routing.routed("old", "a", "r0", tokens=8)  # its report comes after all
        assert routing.policy.placing("a") == 0 and routing.policy.demand("a") == 1

    async def test_the_serve_router_hands_over_the_request_id(self):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        router = AffinityRequestRouter(
            deployment_id=DeploymentID(name="EngineDeployment", app_name="app"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(prefetch_hints=False)
        replicas = [FakeReplica("r0", stats(gpu=["a"]))]
        await router.choose_replicas(replicas, TestRequestRouter().pending("a", "q7"))
        assert router.routing.policy.placing("a") == 1


class TestHints:
    async def test_the_replica_serve_will_pick_hears_of_a_cold_adapter(self):
        board = FakeBoard()
        routing = AffinityRouting(AffinityPolicy(), hints=await ready_sender(board))
        replicas = [FakeReplica("r0", stats()), FakeReplica("r1", stats(host=["a"]))]
        tiers = routing.rank("a", replicas)
        assert board.posts == [(tiers[0][0].name, "a", 0.0)]

    async def test_no_hint_where_the_adapter_is_on_gpu_or_loading(self):
        board = FakeBoard()
        routing = AffinityRouting(AffinityPolicy(), hints=await ready_sender(board))
        routing.rank("a", [FakeReplica("r0", stats(gpu=["a"]))])
        routing.rank("b", [FakeReplica("r0", stats(loading=["b"]))])
        routing.rank(None, [FakeReplica("r0", stats())])
        assert board.posts == []

    async def test_no_hint_that_would_evict(self):
        board = FakeBoard()
        routing = AffinityRouting(AffinityPolicy(), hints=await ready_sender(board))
        routing.rank("a", [FakeReplica("r0", stats(gpu=["x", "y"]))])
        assert board.posts == []

    async def test_in_a_wide_tier_the_shortest_queue_is_hinted(self):
        board = FakeBoard()
        routing = AffinityRouting(
            AffinityPolicy(spread_threshold=1), hints=await ready_sender(board)
        )
        for i in range(3):
            routing.routed(f"q{i}", "a", "elsewhere", 1)  # demand for a: a home of 3+ replicas
        replicas = [FakeReplica(f"r{i}", stats()) for i in range(3)]
        queues = {"r0": 4, "r1": 1, "r2": 3}
        tiers = routing.rank("a", replicas, lambda r: queues[r.name])
        assert len(tiers[0]) == 3
        assert board.posts == [("r1", "a", 0.0)]

    async def test_one_hint_per_adapter_and_replica_per_interval(self):
        clock = Clock()
        board = FakeBoard()
        routing = AffinityRouting(AffinityPolicy(), hints=await ready_sender(board, clock))
        replicas = [FakeReplica("r0", stats())]
        for _ in range(5):
            routing.rank("a", replicas)
        routing.rank("b", replicas)
        assert board.posts == [("r0", "a", 0.0), ("r0", "b", 0.0)]
        clock.now += 0.6
        routing.rank("a", replicas)
        assert board.posts[-1] == ("r0", "a", 0.0) and len(board.posts) == 3

    async def test_hints_are_dropped_until_the_board_is_found_then_sent(self):
        lookups = []

        def lookup():
            lookups.append(1)
            if len(lookups) == 1:
                raise ValueError("no board yet")
            return board

        board = FakeBoard()
        clock = Clock()
        sender = HintSender(lookup, clock=clock, retry_s=1.0)
        assert sender.send("a", "r0") is False
        await asyncio.wait_for(sender._looking_up, 60)  # the lookup failed (a hang guard)
        assert sender.send("a", "r0") is False  # the next lookup waits retry_s
        assert len(lookups) == 1 and sender._looking_up is None
        clock.now += 1.5
        sender.send("a", "r0")
        await until(lambda: sender.board is not None)
        assert sender.send("a", "r0") is True
        assert board.posts == [("r0", "a", 0.0)]

    async def test_a_failed_post_forgets_the_board(self):
        board = FakeBoard(error=RuntimeError("actor died"))
        sender = await ready_sender(board)
        assert sender.send("a", "r0") is True
        await until(lambda: sender.board is None)  # once the post's failure is seen

    async def test_routing_never_fails_over_a_hint(self):
        class Exploding:
            def send(self, adapter, replica_id, eta_s=0.0):
                raise RuntimeError("boom")

        routing = AffinityRouting(AffinityPolicy(), hints=Exploding())
        assert routing.rank("a", [FakeReplica("r0", stats())])

    def test_the_debouncer_is_per_pair(self):
        clock = Clock()
        debouncer = HintDebouncer(0.5, clock)
        assert debouncer.admit("a", "r0") and debouncer.admit("a", "r1")
        assert not debouncer.admit("a", "r0")
        clock.now += 0.5
        assert debouncer.admit("a", "r0")


class TestHintBoard:
    async def test_each_replica_takes_its_own_hints(self):
        clock = Clock()
        board = HintBoard(clock=clock)
        await board.post("r0", "a", 2.0)
        await board.post("r0", "a", 5.0)  # a later hint keeps the earlier due time
        await board.post("r1", "b")
        clock.now += 0.5
        assert await board.take("r0", 0.01) == [("a", 1.5)]
        assert await board.take("r1", 0.01) == [("b", 0.0)]
        assert await board.take("r0", 0.01) == []

    async def test_take_waits_for_a_hint(self):
        board = HintBoard()
        waiter = asyncio.create_task(board.take("r0", 60.0))  # longer than the test by far
        await asyncio.sleep(0.01)  # in this loop: the waiter runs up to its wait
        assert not waiter.done()
        await board.post("r0", "a")
        assert await asyncio.wait_for(waiter, 60.0) == [("a", 0.0)]  # a hang guard

    async def test_pending_hints_are_bounded(self):
        board = HintBoard(max_per_replica=3)
        for name in "abcde":
            await board.post("r0", name)
        assert [a for a, _ in await board.take("r0", 0.01)] == ["c", "d", "e"]

    async def test_a_replica_follows_its_hints_and_survives_board_failures(self):
        board = HintBoard()
        delivered: list[list[tuple[str, float]]] = []
        gets = []

        class Remote:
            """`board.take.remote(...)` as an actor handle has it: awaitable."""

            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return self.fn(*args)

        class Handle:
            take = Remote(board.take)

        def get_board():
            gets.append(1)
            if len(gets) == 1:
                raise ValueError("not created yet")
            return Handle()

        async def deliver(hints):
            delivered.append(hints)

        task = asyncio.create_task(
            follow_hints("r0", get_board, deliver, poll_timeout_s=0.05, retry_s=0.01)
        )
        await board.post("r0", "a")
        await until(lambda: delivered)
        task.cancel()
        assert delivered == [[("a", 0.0)]]
        assert len(gets) == 2


def make_cached_router(clock=None) -> AffinityRequestRouter:
    """As Serve builds it for a deployment with `max_ongoing_requests` (strict): with its
    queue-length cache; `clock` is its time."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = AffinityRequestRouter(
        deployment_id=DeploymentID(name="EngineDeployment", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
        get_curr_time_s=clock,
    )
    router.initialize_state(prefetch_hints=False)
    return router


class TestRequestRouter:
    """The real `RequestRouter` subclass, through the hooks Serve calls."""

    @pytest.fixture
    def router(self):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        router = AffinityRequestRouter(
            deployment_id=DeploymentID(name="EngineDeployment", app_name="app"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(prefetch_hints=False, num_slots=4, imbalance_bound=1.5)
        return router

    def pending(self, adapter: str, request_id: str = "q1"):
        from ray.serve._private.common import RequestMetadata
        from ray.serve.request_router import PendingRequest

        request = GenerateRequest(request_id, [1, 2], SamplingParams(max_tokens=6), adapter or None)
        metadata = RequestMetadata(
            request_id=request_id, internal_request_id=request_id, multiplexed_model_id=adapter
        )
        return PendingRequest(args=[request], kwargs={}, metadata=metadata)

    def test_kwargs_reach_the_policy(self, router):
        assert router.routing.policy.imbalance_bound == 1.5
        assert router.routing.default_num_slots == 4
        assert router.routing.hints is None

    def test_hints_are_on_by_default(self):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        router = AffinityRequestRouter(
            deployment_id=DeploymentID(name="E", app_name="app"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state()
        assert isinstance(router.routing.hints, HintSender)

    async def test_choose_replicas_returns_tiers_and_asks_for_backoff(self, router):
        replicas = [FakeReplica("r0", stats()), FakeReplica("r1", stats(gpu=["a"]))]
        pending = self.pending("a")
        tiers = await router.choose_replicas(replicas, pending)
        assert isinstance(tiers, list) and all(isinstance(t, list) for t in tiers)
        assert tiers[0] == [replicas[1]]
        assert pending.routing_context.should_backoff is True

    async def test_an_empty_model_id_is_the_base_model(self, router):
        replicas = [FakeReplica("r0", stats(running=3)), FakeReplica("r1", stats())]
        tiers = await router.choose_replicas(replicas, self.pending(""))
        assert tiers[0] == [replicas[1]]
        assert await router.choose_replicas(replicas, None)

    async def test_routed_and_completed_hooks_feed_the_policy(self, router):
        from ray.serve._private.common import DeploymentID
        from ray.serve.request_router import ReplicaID

        rid = ReplicaID("r1", DeploymentID(name="EngineDeployment", app_name="app"))
        router.on_request_routed(self.pending("a"), rid, result=None)
        assert router.routing.policy.demand("a") == 1
        assert router.routing.tokens_in_flight("r1") == 8
        router.on_request_completed(rid, "q1")
        assert router.routing.policy.demand("a") == 0
        assert router.routing.tokens_in_flight("r1") == 0

    @pytest.fixture
    def cached_router(self):
        return make_cached_router()

    async def test_a_replica_that_misses_every_probe_is_chosen_from_its_stats(self, cached_router):
        router = cached_router
        busy = ProbedReplica("r0", stats(running=5), answer=5)
        silent = ProbedReplica("r1", stats(running=1, waiting=1), answer=None)
        router.update_replicas([busy])
        assert await router._select_from_candidate_replicas([busy], 0) is busy
        assert await router._select_from_candidate_replicas([busy, silent], 0) is busy
        router.update_replicas([busy, silent])  # the controller's push with r1's first report
        assert router._replica_queue_len_cache.get(silent.replica_id) == 2
        assert await router._select_from_candidate_replicas([busy, silent], 0) is silent

    async def test_only_a_changed_report_fills_a_missing_length(self, cached_router):
        router = cached_router
        replica = ProbedReplica("r0", stats(running=3), answer=None)
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) == 3
        router.on_replica_actor_unavailable(replica.replica_id)
        replica.routing_stats = stats(running=3)  # resent unchanged: maybe older than the loss
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) is None
        replica.routing_stats = stats(running=4)
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) == 4

    @pytest.mark.parametrize(
        "reported", [{}, {"num_running": 2}, {"num_running": -1, "num_waiting": 0}]
    )
    async def test_stats_without_counts_fill_nothing(self, cached_router, reported):
        replica = ProbedReplica("r0", reported, answer=None)
        cached_router.update_replicas([replica])
        assert cached_router._replica_queue_len_cache.get(replica.replica_id) is None

    async def test_stats_never_overwrite_a_cached_length(self, cached_router):
        replica = ProbedReplica("r0", stats(), answer=None)
        cached_router.on_new_queue_len_info(replica.replica_id, 7)  # a request's own answer
        cached_router.update_replicas([replica])
        assert cached_router._replica_queue_len_cache.get(replica.replica_id) == 7

    def test_an_answer_counts_our_sends_still_on_their_way(self, cached_router):
        router, rid = cached_router, FakeId("r0")
        for _ in range(3):
            router.on_send_request(rid)
        router.on_new_queue_len_info(rid, 1)  # the first send, taken: 2 still on the way
        assert router._replica_queue_len_cache.get(rid) == 3
        router.on_new_queue_len_info(rid, 2)
        router.on_new_queue_len_info(rid, 3)
        assert router._replica_queue_len_cache.get(rid) == 3
        router.on_new_queue_len_info(rid, 1)  # more answers than sends: the count as told
        assert router._replica_queue_len_cache.get(rid) == 1

    def test_a_send_never_answered_is_forgotten(self):
        clock = Clock()
        router = make_cached_router(clock)
        rid = FakeId("r0")
        router.on_send_request(rid)  # a broadcast: Serve never hands us its answer
        clock.now += IN_TRANSIT_S + 1
        router.on_send_request(rid)
        router.on_new_queue_len_info(rid, 4)
        assert router._replica_queue_len_cache.get(rid) == 4
        router.on_send_request(rid)
        router.on_replica_actor_unavailable(rid)  # the call failed: no answer will come
        router.on_new_queue_len_info(rid, 2)
        assert router._replica_queue_len_cache.get(rid) == 2

    async def test_a_length_no_recent_answer_backs_gives_way_to_the_replicas_report(self):
        """Once this router stops sending to a replica, its cached length keeps what the other
        routers' requests added and they have finished since: the next report replaces it."""
        clock = Clock()
        router = make_cached_router(clock)
        replica = ProbedReplica("r0", stats(running=2), answer=None)
        router.on_send_request(replica.replica_id)
        router.on_new_queue_len_info(replica.replica_id, 300)  # every router's requests
        clock.now += ANSWER_FRESH_S / 2
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) == 300  # still backed
        clock.now += ANSWER_FRESH_S
        replica.routing_stats = stats(running=3)
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) == 3
        router.on_send_request(replica.replica_id)  # on its way: counted with the next report
        clock.now += ANSWER_FRESH_S
        replica.routing_stats = stats(running=1)
        router.update_replicas([replica])
        assert router._replica_queue_len_cache.get(replica.replica_id) == 2

    async def test_a_burst_is_not_drawn_to_the_replica_slowest_to_answer(self, cached_router):
        """Replica `slow` takes one request for every three this router sends anywhere, and
        answers each with its count then; `quick` takes and answers each at once. Read as
        Serve reads them, `slow`'s answers say it holds fewer than are on their way to it, and
        it would draw most of the burst."""
        router = cached_router
        quick, slow = ProbedReplica("quick", answer=0), ProbedReplica("slow", answer=0)
        router.update_replicas([quick, slow])
        taken = {"quick": 0, "slow": 0}
        sent = {"quick": 0, "slow": 0}
        for i in range(80):
            replica = await router._select_from_candidate_replicas([quick, slow], 0)
            name = replica.replica_id.unique_id
            router.on_send_request(replica.replica_id)
            sent[name] += 1
            if name == "quick":
                taken["quick"] += 1
                router.on_new_queue_len_info(quick.replica_id, taken["quick"])
            if i % 3 == 0 and taken["slow"] < sent["slow"]:
                taken["slow"] += 1
                router.on_new_queue_len_info(slow.replica_id, taken["slow"])
        assert abs(sent["quick"] - sent["slow"]) <= 2, sent

    async def test_a_burst_ranked_in_one_go_is_spread_before_any_send(self, cached_router):
        """Serve's routing tasks pick for every pending request without yielding while cached
        lengths answer, and each request is sent (`on_send_request`) only when its own
        coroutine resumes, after them all: each pick must count on its replica at once, or the
        whole burst goes to the replica that looked shortest when it began."""
        router = cached_router
        short, long = ProbedReplica("short", stats(), answer=0), ProbedReplica("long", stats())
        router.update_replicas([short, long])
        router.on_new_queue_len_info(short.replica_id, 3)
        router.on_new_queue_len_info(long.replica_id, 4)
        burst = [self.pending("", request_id=f"q{i}") for i in range(40)]
        chosen = await asyncio.gather(*(router._choose_replica_for_request(p) for p in burst))
        names = Counter(replica.replica_id.unique_id for replica in chosen)
        assert abs(names["short"] - names["long"]) <= 2, names
        assert router._replica_queue_len_cache.get(short.replica_id) == 3 + names["short"]
        for replica in chosen:  # the sends, once the picks are done: counted already
            router.on_send_request(replica.replica_id)
        assert router._replica_queue_len_cache.get(long.replica_id) == 4 + names["long"]
        router.on_send_request(long.replica_id)  # a send no pick counted (a broadcast)
        assert router._replica_queue_len_cache.get(long.replica_id) == 5 + names["long"]

    async def test_a_diagnostic_run_stamps_each_pick(self, cached_router, tmp_path, monkeypatch):
        """With the hop log on, each request's pick is stamped under its Serve request id
        (`engine_routed`, between the ingress's `engine_call` and the engine's `engine_in`)."""
        from benchmarks.serve_hops import read_hops
        from replicas import hop_log

        monkeypatch.setattr(hop_log, "_folder", str(tmp_path))
        monkeypatch.setattr(hop_log, "_file", None)
        router = cached_router
        replicas = [ProbedReplica("a", stats(), answer=0), ProbedReplica("b", stats(), answer=0)]
        router.update_replicas(replicas)
        for replica in replicas:
            router.on_new_queue_len_info(replica.replica_id, 0)
        burst = [self.pending("", request_id=f"q{i}") for i in range(6)]
        await asyncio.gather(*(router._choose_replica_for_request(p) for p in burst))
        hop_log._file.close()
        hops = read_hops([tmp_path])
        assert sorted(hops) == [f"q{i}" for i in range(6)]
        assert all(set(h) == {"engine_routed"} for h in hops.values())

    def channel(self, replica_id: str, request_id: str = "c1"):
        from ray.serve._private.common import RequestMetadata
        from ray.serve.request_router import PendingRequest

        metadata = RequestMetadata(
            request_id=request_id, internal_request_id=request_id, call_method="channel"
        )
        return PendingRequest(args=["ingress-1", replica_id], kwargs={}, metadata=metadata)

    @pytest.mark.parametrize("router_cls", ["affinity", "pow2"])
    async def test_a_channel_goes_to_the_replica_it_names_or_waits(self, router, router_cls):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        if router_cls == "pow2":
            router = Pow2Router(
                deployment_id=DeploymentID(name="EngineDeployment", app_name="app"),
                handle_source=DeploymentHandleSource.UNKNOWN,
            )
        # r1 is the busier replica with nothing resident: no policy would pick it.
        replicas = [FakeReplica("r0", stats(gpu=["a"])), FakeReplica("r1", stats(running=9))]
        assert await router.choose_replicas(replicas, self.channel("r1")) == [[replicas[1]]]
        assert await router.choose_replicas(replicas, self.channel("gone")) == [[]]

    async def test_a_channel_is_no_placement_the_policy_counts(self, router):
        from ray.serve._private.common import DeploymentID
        from ray.serve.request_router import ReplicaID

        rid = ReplicaID("r1", DeploymentID(name="EngineDeployment", app_name="app"))
        router.on_request_routed(self.channel("r1"), rid, result=None)
        assert not router.routing._routed  # a request would be: see the test above
        router.on_request_routed(self.pending("a"), rid, result=None)
        assert list(router.routing._routed) == ["q1"]


class TestConfig:
    @pytest.mark.parametrize(
        ("args", "cls", "kwargs"),
        [
            ({"router": "pow2"}, "Pow2Router", {}),
            ({}, "AffinityRequestRouter", {"prefetch_hints": False, "num_slots": 8}),
            (
                {"router": "affinity", "enable_prefetch": False, "max_loras_per_batch": 4},
                "AffinityRequestRouter",
                {"prefetch_hints": False, "num_slots": 4},
            ),
        ],
    )
    def test_the_router_arg_picks_serves_request_router(self, args, cls, kwargs):
        from ray.serve.config import RequestRouterConfig

        from app.config import AppArgs
        from app.main import request_router_config

        config = RequestRouterConfig(**request_router_config(AppArgs(**args)))
        assert config.get_request_router_class().__name__ == cls
        assert config.request_router_kwargs == kwargs
        if cls == "AffinityRequestRouter":
            assert config.request_routing_stats_period_s <= 1


class TestRoutingStats:
    """`EngineDeployment.record_routing_stats` on a real small engine, without Serve."""

    @pytest.fixture
    async def deployment(self, tmp_path):
        from replicas.config import EngineConfig
        from replicas.deployment import EngineDeployment, EngineMetrics
        from tests.app.conftest import FakeMetricsBackend
        from tests.factories import make_adapter, make_model

        model = make_model(tmp_path / "model")
        adapters = {
            name: str(make_adapter(model, tmp_path / name, rank=2, target_modules=["q_proj"]))
            for name in ("a", "b")
        }
        config = EngineConfig(
            model=str(model),
            num_kv_blocks=64,
            block_size=4,
            max_lora_rank=4,
            max_loras_per_batch=2,
            adapters=tuple(sorted(adapters.items())),
        )
        deployment = EngineDeployment.func_or_class(
            config, metrics=EngineMetrics(FakeMetricsBackend())
        )
        yield deployment
        deployment.__del__()

    async def test_an_idle_replica_reports_free_slots_and_nothing_resident(self, deployment):
        assert await deployment.record_routing_stats() == {
            "gpu": [],
            "loading": [],
            "host": [],
            "num_slots": 2,
            "free_slots": 2,
            "num_waiting": 0,
            "num_running": 0,
        }

    async def test_a_used_adapter_shows_on_gpu(self, deployment):
        sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        request = GenerateRequest("q", [5, 17], sampling, "a")
        [chunk async for chunk in deployment.generate(request)]
        stats = await deployment.record_routing_stats()
        assert stats["gpu"] == ["a"] and stats["free_slots"] == 1
        assert "b" not in stats["gpu"] + stats["loading"] + stats["host"]
        # And it reads as the policy expects.
        view = replica_view("r0", stats)
        assert "a" in view.gpu and view.free_slots == 1

    async def test_a_busy_engine_gets_the_previous_answer(self, deployment, monkeypatch):
        import replicas.deployment.replica as module

        first = await deployment.record_routing_stats()

        async def never(*args):
            await asyncio.Event().wait()

        monkeypatch.setattr(deployment.engine, "call", never)
        monkeypatch.setattr(module, "ROUTING_STATS_TIMEOUT_S", 0.01)
        assert await deployment.record_routing_stats() == first

    async def test_hints_reach_the_engines_prefetch_queue(self, deployment):
        await deployment._take_hints([("b", 0.0), ("unknown", 0.0)])
        queued = await deployment.engine.call(lambda engine: engine.adapters.queue.ordered())
        assert [name for name, _ in queued] == ["b"]
