"""Ray Serve 2.60's request routing, rule by rule, on the virtual clock.

Each rule below names the function of Ray's source it follows (ray/serve/_private/:
request_router/request_router.py `RequestRouter`, `MultiplexMixin`, `FIFOMixin`;
request_router/pow_2_router.py `PowerOfTwoChoicesRequestRouter`; request_router/common.py
`ReplicaQueueLengthCache`; router.py `AsyncioRouter._route_and_send_request`; controller and
deployment_state `record_request_routing_info`) and, for the replica side, our
replicas/deployment/replica.py `EngineDeployment.publish_residency`.

- `Controller`: replicas push their multiplexed model ids (GPU + loading adapters) and routing
  stats when their residency changes, checked every `push_period_s` (0.1 s); the controller also
  polls routing stats every `stats_period_s`; either marks the deployment dirty, and the
  control loop (every `control_loop_s`, 0.1 s) broadcasts the running replicas to every router,
  which receives them `broadcast_s` later (long poll). A router starts with its handle's first
  request (`DeploymentHandle._init`, called by the first `.options()`: the ingress's engine
  handle is not initialized before); its own first long poll is answered at once with the
  running replicas (router.py `AsyncioRouter`: "a fast initial update"), so it learns them
  `broadcast_s` after that request, not at the next control loop.
- `Router`: one per caller handle. Pending requests queue in FIFO order; up to
  min(pending, 2 x replicas, 50) routing tasks run, each taking the next request to route and
  repeating `choose_replicas` -> pick within each tier -> back off, until that request has a
  replica. Within a tier the replica with the lowest cached queue length below
  `max_ongoing_requests` wins; when none qualifies from the cache, the tier's replicas are
  probed (an RPC), and the lowest that accepts wins. The cache (per router) is set from every
  probe and every send's reply, +1 on each send, -1 on each completion, and expires after 10 s.
  The replica rejects a request when it already has `max_ongoing_requests` (strict mode, the
  default): the router retries it, in order of creation.
- `Pow2Choice`: `PowerOfTwoChoicesRequestRouter.choose_replicas` over `MultiplexMixin`'s
  candidates, and `FIFOMixin`'s hand-off (a replica found by one request's task goes to the
  oldest pending request for the same model id, else the oldest pending one).
- `AffinityChoice`: our `router.routing.AffinityRouting` itself (the object
  `router.serve_router.AffinityRequestRouter` delegates to), fed the same views, with hints
  through the real `HintDebouncer`; no FIFO hand-off (exact match on the request).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.hints import HINT_INTERVAL_S, HintDebouncer
from router.policy import AffinityPolicy
from router.queue_lengths import QueueLengthFeed
from router.routing import DEFAULT_NUM_SLOTS, AffinityRouting
from sim.events import EventLoop, Process, Task


@dataclass(frozen=True)
class ServeConfig:
    """Serve's timings and limits, defaults as Ray 2.60 ships them and as app/main.py sets them."""

    max_ongoing_requests: int = 1024  # app/config.py AppArgs.max_ongoing_requests
    rpc_s: float = 0.0005  # one way, between a router and a replica actor
    push_period_s: float = 0.1  # replicas/deployment/replica.py RESIDENCY_PERIOD_S
    stats_period_s: float = 0.5  # app/main.py ROUTING_STATS_PERIOD_S (Serve's default: 10 s)
    control_loop_s: float = 0.1  # constants.CONTROL_LOOP_INTERVAL_S
    broadcast_s: float = 0.002  # long-poll delivery, controller -> routers
    queue_len_cache_timeout_s: float = 10.0  # RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S
    queue_len_deadline_s: float = 0.1  # RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S
    max_queue_len_deadline_s: float = 1.0  # RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S
    initial_backoff_s: float = 0.025  # RAY_SERVE_ROUTER_RETRY_INITIAL_BACKOFF_S
    backoff_multiplier: float = 2.0  # RAY_SERVE_ROUTER_RETRY_BACKOFF_MULTIPLIER
    max_backoff_s: float = 0.5  # RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S
    matching_timeout_s: float = 1.0  # RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S
    max_routing_tasks_cap: int = 50  # RequestRouter.max_num_routing_tasks_cap
    hint_latency_s: float = 0.002  # router -> hint board -> replica's long poll
    hint_interval_s: float = HINT_INTERVAL_S


@dataclass
class SimRequest:
    """One request as the router and the client see it. `engine` is the replica's `Request`
    once one accepted it."""

    rid: str
    adapter: str | None
    prompt_tokens: int
    output_tokens: int
    created_at: float
    measured: bool = True
    # RequestRoutingContext (request_router/common.py)
    multiplexed_start_matching_time: float | None = None
    tried_fewest_multiplexed_models: bool = False
    tried_first_multiplexed_models: bool = False
    should_backoff: bool = False
    # outcome
    assigned: bool = False  # the pending request's future is set (a replica was found)
    replica_id: str | None = None
    attempts: int = 0  # sends, rejected ones included
    first_token_at: float = math.nan
    finished_at: float = math.nan
    failed: bool = False
    engine: Any = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.created_at


@dataclass(frozen=True)
class ReplicaInfo:
    """What the controller broadcasts of one running replica (`RunningReplicaInfo`)."""

    replica_id: str
    multiplexed_model_ids: frozenset[str] = frozenset()
    routing_stats: Mapping[str, Any] = field(default_factory=dict)


class Endpoint(Protocol):
    """The replicas as routers reach them (the fleet implements it)."""

    def probe(self, replica_id: str) -> int | None:
        """The replica's ongoing requests; None when it is dead."""

    def deliver(self, request: SimRequest, replica_id: str, router: Router) -> None:
        """The request reaches the replica (`try_send_request` with rejection)."""

    def hint(self, replica_id: str, adapter: str) -> None:
        """A prefetch hint reaches the replica's engine."""


class Controller:
    """Serve's controller, for the routing information only."""

    def __init__(self, loop: EventLoop, config: ServeConfig) -> None:
        self.loop = loop
        self.config = config
        self.infos: dict[str, ReplicaInfo] = {}
        self.routers: list[Router] = []
        self._dirty = False
        loop.after(config.control_loop_s, self._control_loop)

    def connect(self, router: Router) -> None:
        """A router starts: its first long poll is answered at once with the running replicas
        (`broadcast_s` later), and it hears every broadcast from then on."""
        if router not in self.routers:
            self.routers.append(router)
        self.loop.after(self.config.broadcast_s, router.update_replicas, list(self.infos.values()))

    def add_replica(self, replica_id: str) -> None:
        self.infos[replica_id] = ReplicaInfo(replica_id)
        self._dirty = True

    def remove_replica(self, replica_id: str) -> None:
        self.infos.pop(replica_id, None)
        self._dirty = True

    def record(
        self,
        replica_id: str,
        model_ids: Iterable[str] | None = None,
        stats: Mapping[str, Any] | None = None,
    ) -> None:
        """`DeploymentState.record_request_routing_info`: keep what came, broadcast later."""
        info = self.infos.get(replica_id)
        if info is None:
            return
        if model_ids is not None:
            info = ReplicaInfo(replica_id, frozenset(model_ids), info.routing_stats)
        if stats is not None:
            info = ReplicaInfo(replica_id, info.multiplexed_model_ids, dict(stats))
        self.infos[replica_id] = info
        self._dirty = True

    def _control_loop(self) -> None:
        if self._dirty:
            self._dirty = False
            snapshot = list(self.infos.values())
            for router in self.routers:
                self.loop.after(self.config.broadcast_s, router.update_replicas, snapshot)
        self.loop.after(self.config.control_loop_s, self._control_loop)


class Choice(Protocol):
    """A router's `choose_replicas` and its hand-off rule."""

    fifo: bool  # FIFOMixin: hand a found replica to the oldest pending request for the model

    def update(self, replicas: Mapping[str, ReplicaInfo]) -> None: ...

    def choose_replicas(self, router: Router, request: SimRequest) -> list[list[str]]: ...

    def routed(self, request: SimRequest, replica_id: str) -> None: ...

    def completed(self, request: SimRequest, replica_id: str) -> None: ...


class Router:
    """`RequestRouter` with its queue-length cache, routing tasks, backoff and the
    rejection protocol of `AsyncioRouter._route_and_send_request`."""

    def __init__(
        self,
        name: str,
        loop: EventLoop,
        endpoint: Endpoint,
        choice: Choice,
        config: ServeConfig,
        rng: random.Random,
        controller: Controller | None = None,
        feed: QueueLengthFeed | None = None,
    ) -> None:
        """`controller`: connected on the first request (the handle's start); None: the
        caller feeds `update_replicas` itself. `feed`: the affinity router's additions to the
        queue-length cache (`router.serve_router.AffinityRequestRouter` overrides Serve's
        hooks with it); None: Serve's own cache, as Ray's default router has it."""
        self.feed = feed
        self.name = name
        self.controller = controller
        self.started = controller is None
        self.loop = loop
        self.endpoint = endpoint
        self.choice = choice
        self.config = config
        self.rng = rng
        self.replicas: dict[str, ReplicaInfo] = {}
        self._cache: dict[str, tuple[int, float]] = {}
        self._to_fulfill: deque[SimRequest] = deque()
        self._to_route: deque[SimRequest] = deque()
        self._tasks: set[Task] = set()
        self._task_of: dict[str, Task] = {}

    # -- replicas and the queue-length cache ----------------------------------------------------

    def update_replicas(self, infos: list[ReplicaInfo]) -> None:
        """`RequestRouter.update_replicas`: the new set, multiplexed ids remapped, cache entries
        of removed replicas dropped, new replicas probed in the background."""
        new = {info.replica_id: info for info in infos}
        added = [rid for rid in new if rid not in self.replicas]
        self.replicas = new
        self._cache = {rid: e for rid, e in self._cache.items() if rid in new}
        self.choice.update(self.replicas)
        if self.feed is not None:
            self.feed.keep_only(new)
            for rid, info in new.items():
                cached = self.cached_queue_len(rid)
                queue_len = self.feed.reported(rid, info.routing_stats, cached, self.loop.now())
                if queue_len is not None:
                    self._cache_set(rid, queue_len)
        if added:
            self.loop.after(2 * self.config.rpc_s, self._probed, added)
        self._maybe_start_tasks()

    def cached_queue_len(self, replica_id: str) -> int | None:
        """`ReplicaQueueLengthCache.get`: None when absent or older than the timeout."""
        entry = self._cache.get(replica_id)
        if entry is None or self.loop.now() - entry[1] > self.config.queue_len_cache_timeout_s:
            return None
        return entry[0]

    def _cache_set(self, replica_id: str, queue_len: int) -> None:
        self._cache[replica_id] = (queue_len, self.loop.now())

    def on_replica_actor_died(self, replica_id: str) -> None:
        """`RequestRouter.on_replica_actor_died`: drop it until the controller says more."""
        if self.replicas.pop(replica_id, None) is not None:
            self._cache.pop(replica_id, None)
            self.choice.update(self.replicas)
        if self.feed is not None:
            self.feed.forget(replica_id)

    def _probed(self, replica_ids: list[str]) -> list[tuple[str, int]]:
        """`_probe_queue_lens`, answered: update the cache; dead replicas are dropped."""
        out = []
        for rid in replica_ids:
            if rid not in self.replicas:
                continue
            queue_len = self.endpoint.probe(rid)
            if queue_len is None:
                self.on_replica_actor_died(rid)
                continue
            self._cache_set(rid, queue_len)
            out.append((rid, queue_len))
        return out

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, request: SimRequest, *, is_retry: bool = False) -> None:
        """`_choose_replica_for_request`: queue it (a retry in order of creation) and start
        routing tasks."""
        request.assigned = False
        if not self.started and self.controller is not None:
            self.started = True
            self.controller.connect(self)
        if is_retry:
            _insert_by_creation(self._to_fulfill, request)
            _insert_by_creation(self._to_route, request)
        else:
            self._to_fulfill.append(request)
            self._to_route.append(request)
        self._maybe_start_tasks()

    def on_reply(
        self, request: SimRequest, replica_id: str, accepted: bool, queue_len: int
    ) -> None:
        """The replica's rejection-protocol answer: the cache takes its queue length; accepted,
        the router hears `on_request_routed`; rejected, the request is routed again."""
        if replica_id in self.replicas:
            if self.feed is not None:
                queue_len = self.feed.answered(replica_id, queue_len, self.loop.now())
            self._cache_set(replica_id, queue_len)
        if accepted:
            self.choice.routed(request, replica_id)
        else:
            self.submit(request, is_retry=True)

    def on_send_failed(self, request: SimRequest, replica_id: str) -> None:
        """The replica was dead (ActorDiedError): forget it and route the request again."""
        self.on_replica_actor_died(replica_id)
        self.submit(request, is_retry=True)

    def on_completed(self, request: SimRequest, replica_id: str) -> None:
        """`decrement_queue_len_cache` and `on_request_completed`."""
        entry = self.cached_queue_len(replica_id)
        if entry is not None:
            self._cache_set(replica_id, max(0, entry - 1))
        self.choice.completed(request, replica_id)

    # -- routing tasks ---------------------------------------------------------------------------

    @property
    def _num_pending(self) -> int:
        # `num_pending_requests`: the fulfil queue, cleaned lazily from the front only.
        while self._to_fulfill and self._to_fulfill[0].assigned:
            self._to_fulfill.popleft()
        return len(self._to_fulfill)

    @property
    def _target_tasks(self) -> int:
        cap = min(self.config.max_routing_tasks_cap, 2 * len(self.replicas))
        return min(self._num_pending, cap)

    def _maybe_start_tasks(self) -> None:
        """`_maybe_start_routing_tasks`. With no replicas known, requests wait for the next
        update, which starts the tasks (Ray's tasks wait on the replicas-updated event)."""
        if not self.replicas:
            return
        for _ in range(self._target_tasks - len(self._tasks)):
            self._tasks.add(self.loop.spawn(self._fulfil_pending))

    def _next_to_route(self) -> SimRequest | None:
        while self._to_route:
            request = self._to_route.popleft()
            if not request.assigned:
                return request
        return None

    def _fulfil_pending(self, task: Task) -> Process:
        """`_fulfill_pending_requests` with `_choose_replicas_with_backoff` inlined."""
        try:
            while len(self._tasks) <= self._target_tasks:
                request = self._next_to_route()
                if request is None:
                    break
                self._task_of[request.rid] = task
                backoff_index = 0
                attempt = 0
                entered_backoff = False
                while not request.assigned:
                    if not self.replicas:  # all gone: the request waits for the next update
                        self._to_route.appendleft(request)
                        self._task_of.pop(request.rid, None)
                        return
                    for tier in self.choice.choose_replicas(self, request):
                        if not tier:
                            continue
                        if request.assigned:
                            break
                        chosen = yield from self._select(tier, backoff_index)
                        if chosen is not None:
                            self._fulfil_next(chosen, request, task)
                            if request.assigned:
                                break
                            continue
                        backoff_index += 1
                    if request.assigned:
                        break
                    if not request.should_backoff:
                        continue
                    if not entered_backoff:
                        entered_backoff = True  # the first retry goes at once
                    else:
                        yield self._backoff_s(attempt)
                        attempt += 1
                if self._task_of.get(request.rid) is task:
                    del self._task_of[request.rid]
        finally:
            self._tasks.discard(task)
            if self._to_route:  # requests came while this task was finishing
                self.loop.after(0.0, self._maybe_start_tasks)

    def _backoff_s(self, attempt: int) -> float:
        """`_compute_backoff_s`."""
        c = self.config
        return min(c.initial_backoff_s * c.backoff_multiplier**attempt, c.max_backoff_s)

    def _select(self, tier: list[str], backoff_index: int) -> Generator[float, None, str | None]:
        """`_select_from_candidate_replicas`: the lowest cached queue length with room; else
        probe those without a usable entry and take the lowest that has room. Returns the
        replica id or None (through StopIteration's value: use `yield from`)."""
        max_ongoing = self.config.max_ongoing_requests
        lowest = math.inf
        chosen: str | None = None
        not_in_cache: list[str] = []
        for rid in tier:
            queue_len = self.cached_queue_len(rid)
            if queue_len is None or queue_len >= max_ongoing:
                not_in_cache.append(rid)
            elif queue_len < lowest:
                lowest, chosen = queue_len, rid
        if chosen is None:
            deadline = min(
                self.config.queue_len_deadline_s * 2**backoff_index,
                max(self.config.queue_len_deadline_s, self.config.max_queue_len_deadline_s),
            )
            if 2 * self.config.rpc_s > deadline:
                yield deadline  # no answer in time: none qualifies
                return None
            yield 2 * self.config.rpc_s
            for rid, queue_len in self._probed(not_in_cache):
                if queue_len < max_ongoing and queue_len < lowest:
                    lowest, chosen = queue_len, rid
        elif not_in_cache:
            self.loop.after(2 * self.config.rpc_s, self._probed, not_in_cache)
        if chosen is None or chosen not in self.replicas:
            return None
        return chosen

    def _fulfil_next(self, replica_id: str, request: SimRequest, task: Task) -> None:
        """`_fulfill_next_pending_request`: FIFOMixin's (the oldest pending request for the
        same multiplexed model id, else the oldest pending) or the base class's exact match."""
        target = request
        if self.choice.fifo:
            oldest = None
            if request.adapter:
                same = (r for r in self._to_fulfill if r.adapter == request.adapter)
                oldest = next((r for r in same if not r.assigned), None)
            if oldest is None:
                oldest = next((r for r in self._to_fulfill if not r.assigned), None)
            if oldest is None:
                return
            target = oldest
        target.assigned = True
        owner = self._task_of.pop(target.rid, None)
        if owner is not None and owner is not task:
            owner.cancel()
            self._tasks.discard(owner)
        self._send(target, replica_id)

    def _send(self, request: SimRequest, replica_id: str) -> None:
        """`try_send_request` then `on_send_request` (+1 in the cache)."""
        request.attempts += 1
        request.replica_id = replica_id
        self._cache_set(replica_id, (self.cached_queue_len(replica_id) or 0) + 1)
        if self.feed is not None:
            self.feed.sent(replica_id, self.loop.now())
        self.loop.after(self.config.rpc_s, self.endpoint.deliver, request, replica_id, self)


def _insert_by_creation(queue: deque[SimRequest], request: SimRequest) -> None:
    """`_insert_pending_request_sorted`."""
    if not queue or request.created_at >= queue[-1].created_at:
        queue.append(request)
        return
    for i, other in enumerate(queue):
        if request.created_at < other.created_at:
            queue.insert(i, request)
            return
    queue.append(request)


# ---------------------------------------------------------------------------------------------
# Ray's default: PowerOfTwoChoicesRequestRouter = FIFOMixin + LocalityMixin + MultiplexMixin.


class Pow2Choice:
    """`PowerOfTwoChoicesRequestRouter.choose_replicas` over `MultiplexMixin`. Locality plays
    no part on one node (LocalityMixin then offers every replica)."""

    fifo = True

    def __init__(self, rng: random.Random, config: ServeConfig) -> None:
        self.rng = rng
        self.config = config
        self._by_model: dict[str, set[str]] = {}
        self._fallback_match: set[str] = set()  # `_multiplexed_model_id_fallback_match`
        self._num_models: dict[str, int] = {}

    def update(self, replicas: Mapping[str, ReplicaInfo]) -> None:
        """`_update_multiplexed_model_ids_with_replicas`."""
        by_model: dict[str, set[str]] = {}
        for rid, info in replicas.items():
            for model_id in info.multiplexed_model_ids:
                by_model.setdefault(model_id, set()).add(rid)
        self._by_model = by_model
        self._num_models = {rid: len(i.multiplexed_model_ids) for rid, i in replicas.items()}

    def _fewest_models(self) -> set[str]:
        """`_get_replica_ids_with_fewest_multiplexed_models`."""
        if not self._num_models:
            return set()
        least = min(self._num_models.values())
        return {rid for rid, n in self._num_models.items() if n == least}

    def _matching_timeout(self) -> float:
        """`_multiplexed_matching_timeout`: drawn anew at every look."""
        t = self.config.matching_timeout_s
        return self.rng.uniform(t, 2 * t)

    def apply_multiplex_routing(self, router: Router, request: SimRequest) -> set[str]:
        """`MultiplexMixin.apply_multiplex_routing`."""
        now = router.loop.now()
        if request.multiplexed_start_matching_time is None:  # Ray's `not ...`: time.time() > 0
            request.multiplexed_start_matching_time = now
        model_id = request.adapter
        assert model_id  # `choose_replicas` sends only requests for an adapter here
        if now - request.multiplexed_start_matching_time < self._matching_timeout():
            candidates = set(self._by_model.get(model_id, ()))
            if (
                not candidates and model_id not in self._fallback_match
            ) or request.tried_first_multiplexed_models:
                candidates = self._fewest_models()
                self._fallback_match.add(model_id)
            elif candidates:
                self._fallback_match.discard(model_id)
            request.tried_first_multiplexed_models = True
        elif not request.tried_fewest_multiplexed_models:
            candidates = self._fewest_models()
            request.tried_fewest_multiplexed_models = True
        else:
            candidates = set(router.replicas)
        request.should_backoff = True
        return candidates

    def choose_replicas(self, router: Router, request: SimRequest) -> list[list[str]]:
        """`PowerOfTwoChoicesRequestRouter.choose_replicas`: two at random from the candidates
        (one if only one), in random order."""
        if request.adapter:
            candidates = self.apply_multiplex_routing(router, request)
        else:
            candidates = set(router.replicas)  # `apply_locality_routing`, no locality
            request.should_backoff = True
        candidates &= set(router.replicas)
        if not candidates:
            return []
        ids = sorted(candidates)  # a set's order is arbitrary; sorting keeps runs repeatable
        n = len(ids)
        if n == 1:
            return [ids]
        if n == 2:
            return [ids if self.rng.getrandbits(1) else ids[::-1]]
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        j += j >= i
        return [[ids[i], ids[j]]]

    def routed(self, request: SimRequest, replica_id: str) -> None:
        pass

    def completed(self, request: SimRequest, replica_id: str) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Ours: router/serve_router.py AffinityRequestRouter.


class _Id:
    __slots__ = ("unique_id",)

    def __init__(self, unique_id: str) -> None:
        self.unique_id = unique_id


class _Running:
    """What `AffinityRouting` reads of a `RunningReplica`."""

    __slots__ = ("replica_id", "routing_stats")

    def __init__(self, info: ReplicaInfo) -> None:
        self.replica_id = _Id(info.replica_id)
        self.routing_stats = info.routing_stats


class SimHints:
    """`router.hints.HintSender` with the board found: the real debouncer, then the hint
    reaches the replica's engine after `latency_s`."""

    def __init__(self, loop: EventLoop, endpoint: Endpoint, config: ServeConfig) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.latency_s = config.hint_latency_s
        self.debouncer = HintDebouncer(config.hint_interval_s, clock=loop.now)
        self.num_sent = 0

    def send(self, adapter: str, replica_id: str) -> bool:
        if not self.debouncer.admit(adapter, replica_id):
            return False
        self.num_sent += 1
        self.loop.after(self.latency_s, self.endpoint.hint, replica_id, adapter)
        return True


class AffinityChoice:
    """`AffinityRequestRouter.choose_replicas`: the real `AffinityRouting` over the broadcast
    routing stats and this router's queue-length cache (`_cached_queue_len`)."""

    fifo = False

    def __init__(
        self,
        hints: SimHints | None = None,
        *,
        num_slots: int = DEFAULT_NUM_SLOTS,
        policy_kwargs: Mapping[str, Any] | None = None,
        clock: Callable[[], float],
    ) -> None:
        """`clock`: the simulation's (`EventLoop.now`), for how long a request has been placing."""
        self.hints = hints
        self.routing = AffinityRouting(
            AffinityPolicy(**dict(policy_kwargs or {})),
            hints=hints,
            default_num_slots=num_slots,
            clock=clock,
        )
        self._running: list[_Running] = []

    def update(self, replicas: Mapping[str, ReplicaInfo]) -> None:
        self._running = [_Running(info) for info in replicas.values()]

    def choose_replicas(self, router: Router, request: SimRequest) -> list[list[str]]:
        request.should_backoff = True
        cached: Callable[[_Running], int | None] = lambda r: router.cached_queue_len(
            r.replica_id.unique_id
        )
        tiers = self.routing.rank(request.adapter, self._running, cached, request.rid)
        return [[r.replica_id.unique_id for r in tier] for tier in tiers]

    def routed(self, request: SimRequest, replica_id: str) -> None:
        self.routing.routed(request.rid, request.adapter, replica_id, request.tokens)

    def completed(self, request: SimRequest, replica_id: str) -> None:
        self.routing.finished(request.rid, replica_id)
