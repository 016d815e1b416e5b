"""Routing simulator: a discrete-event model of a fleet of LoRA replicas behind M router
instances, for comparing routing policies on adapter loads, balance and time to first token.
Plain Python (heapq, seeded `random`): no Ray, no torch.

Each replica models what the engine does (replicas/):
- `num_slots` GPU adapter slots, least recently used evicted first; a slot held by a running
  request or still loading is never evicted, and a load in flight counts against capacity.
- A pinned host cache of `host_capacity` adapters (LRU); a miss reads disk → host first.
  Disk reads and host→GPU copies each go through one FIFO channel per replica.
- Continuous batching of up to `max_num_seqs` sequences. Every step decodes one token for each
  running sequence and prefills the ones admitted at its start:
  step_s = step_base_s + step_per_seq_s · batch + prefill_per_token_s · prompt tokens admitted.
  A request's first token comes at the end of its prefill step, so
  TTFT = queue wait + adapter wait + prefill (and the step it shares).
- A request is admitted only once its adapter's slot is ready; requests behind it whose adapters
  are ready may go first (as vLLM and SGLang skip ahead). When a request has waited longer than
  `starvation_s` for a slot, the least recently used held adapter stops taking new requests
  until its slot drains, so no adapter starves.

Each router instance sees replicas the way a Ray Serve router does: the adapter sets (GPU,
loading, host) and free slots come from a snapshot refreshed every `stats_period_s` (phases
staggered across routers); queue_len is the snapshot's queue length, corrected by the requests
this router itself sent or saw finish since. Requests are shared among the routers at random.
The caller's rule is Serve's: the shortest queue with room (below `max_ongoing_requests`) in the
first tier that has any; with no room anywhere the request still goes to the first tier's
shortest queue.

Between the router and the engine (all off by default, so a routed request is in the replica's
queue at once):
- `dispatch_s`: ingress/transport latency from the caller's send to the engine's queue.
- `hold_at_caller`: Serve's `max_ongoing_requests`. A request whose replica already has that
  many requests sent and unfinished waits in the caller, in order, and is sent when one of them
  finishes. (Serve re-runs the choice while it holds a request; the model keeps the first
  choice, which is the first tier's shortest queue.) A replica's queue length as routers see it
  counts the requests sent to it and those held for it.
- `prefetch_hints`: router-fed prefetch (router/serve_router.py, router/hints.py,
  replicas/adapters/prefetcher.py). At routing time the router hints the first tier's shortest
  queue, unless its (stale) view shows the adapter there on the GPU or loading, or, with
  `hint_free_slots_only` (as the router is written), shows no free slot; one hint per
  (adapter, replica) per router each `hint_interval_s`. The hint reaches the replica after
  `hint_latency_s`, due then. The replica keeps at most `hint_capacity` hints (the latest due
  gives way), drops them `hint_ttl_s` after they were due or when a request for the adapter is
  admitted, starts the disk read at once (if it holds no more hints than host entries), and
  gives the adapter a slot soonest-due first: a free slot, else the idle slot whose next need
  is latest, only when that need is strictly later than the hint's (the prefetcher's rule). Needs
  are waiting requests (due when they reached the replica) and other hints; a held slot, a slot
  still loading, or any slot while a waiting request is blocked without one, is never taken.
  A waiting request's own load may take an idle hinted slot, only after every idle slot no one
  needs (it is needed now; the hinted request is not there yet).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from router.policy import ReplicaView, RoutingPolicy


class SimulationError(AssertionError):
    """An invariant of the replica model was broken (a bug in the simulator)."""


@dataclass(frozen=True)
class Workload:
    """Which adapters requests name, and how fast they come.

    kind: "uniform" (every adapter equally likely), "zipf" (adapter of popularity rank i drawn
    with weight 1/i^alpha), "skewed" (geometric: rank i drawn with weight alpha^i, alpha in
    (0, 1], as benchmarks/loadgen/popularity.py's "skewed"), or "bursty" (`phases` equal spans,
    each a Zipf(alpha) over a fresh random ranking of the adapters, the arrival rate alternating
    × (1 - burst, 1 + burst)).
    """

    kind: str = "zipf"
    alpha: float = 1.0
    phases: int = 4
    burst: float = 0.25
    base_fraction: float = 0.0  # share of requests for the base model (adapter None)

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "zipf", "skewed", "bursty"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
        if self.kind == "skewed" and not 0 < self.alpha <= 1:
            raise ValueError("a geometric (skewed) workload needs alpha in (0, 1]")
        if not 0 <= self.burst < 1:
            raise ValueError("burst must be in [0, 1)")

    @property
    def name(self) -> str:
        if self.kind == "uniform":
            return "uniform"
        return f"{self.kind}{self.alpha:g}"


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 64
    num_adapters: int = 1000
    num_requests: int = 20_000
    workload: Workload = field(default_factory=Workload)
    load_fraction: float = 0.7  # arrival rate / nominal fleet capacity (see `capacity_rps`)
    num_slots: int = 8  # max_loras_per_batch
    host_capacity: int = 64  # max_loaded_loras
    max_num_seqs: int = 64
    max_ongoing_requests: int = 128
    # Llama-3-8B on an H100, rank-16 adapters (about 80 MB): DESIGN.md's reference numbers.
    step_base_s: float = 0.012
    step_per_seq_s: float = 0.00015
    prefill_per_token_s: float = 0.00004  # 25k prompt tokens/s
    host_to_gpu_s: float = 0.0015  # 80 MB over pinned PCIe
    disk_to_host_s: float = 0.04  # 80 MB at 2 GB/s
    prompt_tokens: tuple[int, int] = (128, 512)  # uniform, inclusive
    output_tokens: tuple[int, int] = (64, 192)  # uniform, inclusive
    stats_period_s: float = 1.0
    num_routers: int = 2
    starvation_s: float = 0.5
    scan_limit: int = 256  # waiting requests the scheduler looks at per step
    # Metrics skip the first requests: every fleet starts with empty slots and host caches, and
    # that cold start says nothing about a policy.
    warmup_fraction: float = 0.2
    seed: int = 0
    # Between the router and the engine (see the module docstring); the defaults send a request
    # into its replica's queue the moment it is routed.
    dispatch_s: float = 0.0
    hold_at_caller: bool = False
    prefetch_hints: bool = False
    hint_latency_s: float = 0.001
    hint_interval_s: float = 0.5  # router/hints.py HINT_INTERVAL_S
    hint_free_slots_only: bool = True  # router/serve_router.py hints only into a free slot
    hint_ttl_s: float = 30.0  # replicas/adapters/manager.py HINT_TTL_S
    hint_capacity: int = 256

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_adapters < 1 or self.num_requests < 1:
            raise ValueError("need at least one replica, adapter and request")
        if self.num_slots < 1 or self.host_capacity < 1 or self.max_num_seqs < 1:
            raise ValueError("slots, host cache and batch need room for at least one")
        if not 0 < self.load_fraction:
            raise ValueError("load_fraction must be positive")
        if self.num_routers < 1:
            raise ValueError("need at least one router")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must be in [0, 1)")
        if min(self.dispatch_s, self.hint_latency_s, self.hint_interval_s, self.hint_ttl_s) < 0:
            raise ValueError("latencies, intervals and lifetimes cannot be negative")
        if self.hint_capacity < 1:
            raise ValueError("the hint queue needs room for at least one hint")

    @property
    def replica_rps(self) -> float:
        """Requests/s one replica sustains at a full batch with no adapter waits."""
        mean_prompt = sum(self.prompt_tokens) / 2
        mean_out = sum(self.output_tokens) / 2
        b = self.max_num_seqs
        per_request = self.prefill_per_token_s * mean_prompt + mean_out * (
            self.step_base_s / b + self.step_per_seq_s
        )
        return 1.0 / per_request

    @property
    def capacity_rps(self) -> float:
        return self.num_replicas * self.replica_rps


PolicyFactory = Callable[[int], RoutingPolicy]  # router index -> a fresh policy instance


@dataclass
class SimResult:
    policy: str
    workload: str
    num_adapters: int
    num_replicas: int
    num_requests: int  # measured, after the warm-up
    finished: int  # all requests, warm-up included
    sim_time_s: float
    hit_rate: float  # adapter in a GPU slot (ready or loading) when the request reached it
    loads_per_1k: float  # host→GPU copies per 1,000 requests
    disk_reads_per_1k: float
    imbalance_requests: float  # max / mean of measured requests routed per replica
    imbalance_queue: float  # max / mean of time-averaged queue length per replica (measured)
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    ttft_mean_s: float = 0.0
    # From reaching the replica until the adapter's slot was ready there (0 when it already
    # was), averaged over every measured request.
    adapter_wait_mean_s: float = 0.0
    held_fraction: float = 0.0  # share of requests held in the caller (max_ongoing_requests)
    caller_wait_mean_s: float = 0.0  # mean time from routing to sending, over all requests
    hints_per_1k: float = 0.0  # hints that reached a replica
    hints_misdirected_per_1k: float = 0.0  # hinted a replica other than the one chosen
    hint_loads_per_1k: float = 0.0  # host→GPU copies a hint started
    hint_loads_wasted_per_1k: float = 0.0  # of those, evicted before any request used them
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Requests and workload generation.


class _Request:
    __slots__ = (
        "rid",
        "adapter",
        "arrival",
        "prompt",
        "output",
        "router",
        "replica",
        "ttft",
        "sent",
        "reached",
        "adapter_wait",
    )

    def __init__(self, rid: int, adapter: str | None, arrival: float, prompt: int, output: int):
        self.rid = rid
        self.adapter = adapter
        self.arrival = arrival  # routed at this time; TTFT counts from here
        self.prompt = prompt
        self.output = output
        self.router = 0
        self.replica = -1
        self.ttft = math.nan
        self.sent = math.nan  # left the caller (later than `arrival` when held there)
        self.reached = math.nan  # entered the replica's waiting queue
        self.adapter_wait = 0.0


def generate_requests(config: SimConfig, rng: random.Random) -> list[_Request]:
    """The whole arrival stream, Poisson at `load_fraction` × capacity (bursty: per phase)."""
    w = config.workload
    names = [f"adapter-{i:05d}" for i in range(config.num_adapters)]
    rate = config.load_fraction * config.capacity_rps
    n = config.num_requests

    def ranking() -> list[str]:
        order = names[:]
        rng.shuffle(order)  # popularity is not tied to names, nor to the hash of names
        return order

    def cumulative_weights() -> list[float]:
        if w.kind == "skewed":
            weights = (w.alpha**i for i in range(len(names)))
        else:
            weights = (1.0 / (i + 1) ** w.alpha for i in range(len(names)))
        return list(itertools.accumulate(weights))

    phases = w.phases if w.kind == "bursty" else 1
    per_phase = math.ceil(n / phases)
    requests: list[_Request] = []
    t = 0.0
    for phase in range(phases):
        order = ranking()
        cum = None if w.kind == "uniform" else cumulative_weights()
        phase_rate = rate
        if w.kind == "bursty":
            phase_rate = rate * (1 - w.burst if phase % 2 == 0 else 1 + w.burst)
        count = min(per_phase, n - len(requests))
        if cum is None:
            picks = [rng.randrange(len(order)) for _ in range(count)]
        else:
            picks = [
                min(i, len(order) - 1)
                for i in (_bisect_cum(cum, rng.random() * cum[-1]) for _ in range(count))
            ]
        for pick in picks:
            t += rng.expovariate(phase_rate)
            adapter: str | None = order[pick]
            if w.base_fraction and rng.random() < w.base_fraction:
                adapter = None
            prompt = rng.randint(*config.prompt_tokens)
            output = rng.randint(*config.output_tokens)
            requests.append(_Request(len(requests), adapter, t, prompt, output))
    return requests


def _bisect_cum(cum: list[float], x: float) -> int:
    return bisect.bisect_right(cum, x)


# ---------------------------------------------------------------------------------------------
# One replica.


class _Slot:
    __slots__ = ("holds", "ready", "ready_at", "hinted")

    def __init__(self, hinted: bool = False) -> None:
        self.holds = 0
        self.ready = False
        self.ready_at = math.inf
        self.hinted = hinted  # loaded by a hint, no request has used it yet


class _Replica:
    def __init__(self, index: int, replica_id: str) -> None:
        self.index = index
        self.replica_id = replica_id
        self.slots: OrderedDict[str, _Slot] = OrderedDict()  # least recently used first
        self.host: OrderedDict[str, float] = OrderedDict()  # adapter -> time it is on host
        self.waiting: deque[_Request] = deque()
        self.wanting: dict[str, int] = {}  # waiting requests per adapter
        self.running = 0
        self.admitted: list[_Request] = []  # to prefill in the next step
        self.finishing: list[tuple[int, int, _Request]] = []  # (last step, rid, request)
        self.step = 0
        self.busy = False
        self.disk_free = 0.0
        self.copy_free = 0.0
        self.draining: str | None = None
        self.starving_since = math.inf
        # Between the router and the engine queue.
        self.held: deque[_Request] = deque()  # waiting in the callers for room here
        self.in_transit = 0
        # The prefetcher's hints: adapter -> due; `unplaced` are those without a slot.
        self.hints: dict[str, float] = {}
        self.unplaced: dict[str, float] = {}
        self.next_expiry = 0.0
        # metrics
        self.routed = 0
        self.queue_area = 0.0
        self.queue_t = 0.0

    @property
    def queue_len(self) -> int:
        """Requests in the engine: waiting and running."""
        return len(self.waiting) + self.running

    @property
    def ongoing(self) -> int:
        """Requests sent here and not finished (what `max_ongoing_requests` bounds)."""
        return self.in_transit + self.queue_len

    @property
    def committed(self) -> int:
        """Requests routed here and not finished, those held in the callers included."""
        return self.ongoing + len(self.held)

    def account(self, now: float) -> None:
        self.queue_area += self.queue_len * (now - self.queue_t)
        self.queue_t = now


# ---------------------------------------------------------------------------------------------
# One router instance's view of the fleet.


class _RouterState:
    def __init__(self, index: int, policy: RoutingPolicy, replicas: list[_Replica]) -> None:
        self.index = index
        self.policy = policy
        self.ids = [r.replica_id for r in replicas]
        self.position = {rid: i for i, rid in enumerate(self.ids)}
        n = len(replicas)
        self.own = [0] * n  # requests this router sent, not yet finished, per replica
        self.own_at_snapshot = [0] * n
        self.queue_at_snapshot = [0] * n
        self.views = [ReplicaView(rid) for rid in self.ids]
        self.last_hint: dict[tuple[str, int], float] = {}  # (adapter, replica) -> when hinted

    def queue_estimate(self, i: int) -> int:
        return max(0, self.queue_at_snapshot[i] - self.own_at_snapshot[i] + self.own[i])

    def refresh(self, replicas: list[_Replica], now: float, num_slots: int) -> None:
        for i, rep in enumerate(replicas):
            gpu = frozenset(a for a, s in rep.slots.items() if s.ready)
            loading = frozenset(a for a, s in rep.slots.items() if not s.ready)
            host = frozenset(a for a, ready_at in rep.host.items() if ready_at <= now)
            self.queue_at_snapshot[i] = rep.committed
            self.own_at_snapshot[i] = self.own[i]
            self.views[i] = ReplicaView(
                replica_id=rep.replica_id,
                gpu=gpu,
                loading=loading,
                host=host,
                num_slots=num_slots,
                free_slots=num_slots - len(rep.slots),
                queue_len=rep.committed,
            )

    def bump(self, i: int, delta: int) -> None:
        self.own[i] += delta
        self.views[i] = replace(self.views[i], queue_len=self.queue_estimate(i))

    def choose(self, adapter: str | None, max_ongoing: int) -> tuple[int, list[list[str]]]:
        """The replica the request goes to, and the policy's tiers it was chosen from."""
        tiers = self.policy.rank(adapter, self.views)
        for tier in tiers:
            best = -1
            best_q = max_ongoing
            for rid in tier:
                i = self.position[rid]
                q = self.views[i].queue_len
                if q < best_q:
                    best, best_q = i, q
            if best >= 0:
                return best, tiers
        # No room anywhere: the first tier's shortest queue.
        return self.first_tier_shortest(tiers), tiers

    def first_tier_shortest(self, tiers: list[list[str]]) -> int:
        return min((self.position[rid] for rid in tiers[0]), key=lambda i: self.views[i].queue_len)

    def hint_target(
        self, adapter: str, tiers: list[list[str]], now: float, config: SimConfig
    ) -> int | None:
        """The replica to hint, as router/serve_router.py picks it (the first tier's shortest
        queue), or None when its view or the debounce says not to."""
        i = self.first_tier_shortest(tiers)
        view = self.views[i]
        if adapter in view.gpu or adapter in view.loading:
            return None
        if config.hint_free_slots_only and view.free_slots == 0:
            return None
        key = (adapter, i)
        last = self.last_hint.get(key)
        if last is not None and now - last < config.hint_interval_s:
            return None
        self.last_hint[key] = now
        return i


# ---------------------------------------------------------------------------------------------

_ARRIVAL, _STEP_END, _LOAD_DONE, _SNAPSHOT, _REACH, _HINT = range(6)


@dataclass(frozen=True)
class LogEntry:
    """One event of a recorded run (`Simulation(..., record=True).log`).

    kind: "route" (the router chose `replica` for request `rid`), "reach" (it entered that
    replica's queue), "hint" (a hint for `adapter` reached `replica`; `due` is its due time),
    "load" (a slot was given to `adapter` and its load started; `cause` "hint" or "demand";
    `victim` the adapter evicted for it, with the holds it had and its next need: the earliest
    of the waiting requests' arrivals and its hint's due, inf when none).
    """

    t: float
    kind: str
    replica: int
    adapter: str | None = None
    rid: int | None = None
    cause: str = ""
    due: float = math.inf
    victim: str | None = None
    victim_holds: int = 0
    victim_need: float = math.inf


class Simulation:
    """One run: `Simulation(config, make_policy).run()` → SimResult.

    `on_evict(replica_id, adapter, holds)` is called for every GPU-slot eviction, before it
    happens; the simulator itself raises SimulationError if `holds` is not 0 or the slot is still
    loading, so a hook may only observe. `record=True` keeps a `log` of LogEntry (slower).
    `requests`, (arrival, adapter, prompt tokens, output tokens) in arrival order, replaces the
    generated stream (a trace, or a hand-made case)."""

    def __init__(
        self,
        config: SimConfig,
        make_policy: PolicyFactory,
        *,
        policy_name: str = "",
        on_evict: Callable[[str, str, int], None] | None = None,
        record: bool = False,
        requests: Sequence[tuple[float, str | None, int, int]] | None = None,
    ) -> None:
        self.config = config
        self.policy_name = policy_name
        self.on_evict = on_evict
        self.log: list[LogEntry] | None = [] if record else None
        self.rng = random.Random(config.seed)
        if requests is None:
            self.requests = generate_requests(config, self.rng)
        else:
            if not requests:
                raise ValueError("need at least one request")
            self.requests = [
                _Request(i, adapter, arrival, prompt, output)
                for i, (arrival, adapter, prompt, output) in enumerate(requests)
            ]
            if any(a.arrival > b.arrival for a, b in itertools.pairwise(self.requests)):
                raise ValueError("requests must be in arrival order")
        self.replicas = [_Replica(i, f"replica-{i:03d}") for i in range(config.num_replicas)]
        self.routers = [
            _RouterState(i, make_policy(i), self.replicas) for i in range(config.num_routers)
        ]
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.hits = 0
        self.loads = 0
        self.disk_reads = 0
        self.hints_sent = 0
        self.hints_misdirected = 0
        self.hint_loads = 0
        self.hint_loads_wasted = 0
        self.finished = 0
        self.first_measured = int(config.warmup_fraction * len(self.requests))
        self.measured_since = 0.0

    def _push(self, t: float, kind: int, payload: object) -> None:
        if t < self.now:
            raise SimulationError(f"event scheduled in the past: {t} < {self.now}")
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    # -- run ----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        c = self.config
        for router in self.routers:
            router.refresh(self.replicas, 0.0, c.num_slots)
            self._push(c.stats_period_s * (router.index + 1) / c.num_routers, _SNAPSHOT, router)
        arrivals = iter(self.requests)
        first = next(arrivals)
        self._push(first.arrival, _ARRIVAL, first)
        pending = len(self.requests)
        while self._events and self.finished < pending:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVAL:
                self._route(payload)  # type: ignore[arg-type]
                nxt = next(arrivals, None)
                if nxt is not None:
                    self._push(nxt.arrival, _ARRIVAL, nxt)
            elif kind == _STEP_END:
                self._step_end(payload)  # type: ignore[arg-type]
            elif kind == _LOAD_DONE:
                rep, adapter = payload  # type: ignore[misc]
                slot = rep.slots[adapter]
                slot.ready = True
                slot.ready_at = t
                if not rep.busy:
                    self._schedule(rep)
            elif kind == _REACH:
                req: _Request = payload  # type: ignore[assignment]
                self.replicas[req.replica].in_transit -= 1
                self._reach(req)
            elif kind == _HINT:
                rep, adapter = payload  # type: ignore[misc]
                self._take_hint(rep, adapter)
            else:
                router = payload
                router.refresh(self.replicas, t, c.num_slots)  # type: ignore[union-attr]
                self._push(t + c.stats_period_s, _SNAPSHOT, router)
        return self._result(time.perf_counter() - wall)

    # -- routing ------------------------------------------------------------------------------

    def _start_measuring(self) -> None:
        self.hits = self.loads = self.disk_reads = 0
        self.hints_sent = self.hints_misdirected = self.hint_loads = self.hint_loads_wasted = 0
        for rep in self.replicas:
            rep.account(self.now)
            rep.routed = 0
            rep.queue_area = 0.0
        self.measured_since = self.now

    def _route(self, req: _Request) -> None:
        c = self.config
        if req.rid == self.first_measured:
            self._start_measuring()
        router = self.routers[self.rng.randrange(len(self.routers))]
        req.router = router.index
        i, tiers = router.choose(req.adapter, c.max_ongoing_requests)
        router.policy.on_routed(req.adapter, router.ids[i])
        router.bump(i, +1)
        rep = self.replicas[i]
        req.replica = i
        rep.routed += 1
        if self.log is not None:
            self.log.append(LogEntry(self.now, "route", i, req.adapter, req.rid))
        if c.prefetch_hints and req.adapter is not None:
            target = router.hint_target(req.adapter, tiers, self.now, c)
            if target is not None:
                self.hints_sent += 1
                self.hints_misdirected += target != i
                self._push(self.now + c.hint_latency_s, _HINT, (self.replicas[target], req.adapter))
        if c.hold_at_caller and (rep.held or rep.ongoing >= c.max_ongoing_requests):
            rep.held.append(req)
        else:
            self._send(rep, req)

    def _send(self, rep: _Replica, req: _Request) -> None:
        if self.config.hold_at_caller and rep.ongoing >= self.config.max_ongoing_requests:
            raise SimulationError(f"{rep.replica_id} sent more than max_ongoing_requests")
        req.sent = self.now
        if self.config.dispatch_s > 0:
            rep.in_transit += 1
            self._push(self.now + self.config.dispatch_s, _REACH, req)
        else:
            self._reach(req)

    def _reach(self, req: _Request) -> None:
        """The request enters its replica's waiting queue."""
        rep = self.replicas[req.replica]
        req.reached = self.now
        if self.log is not None:
            self.log.append(LogEntry(self.now, "reach", rep.index, req.adapter, req.rid))
        if req.adapter is None or req.adapter in rep.slots:
            self.hits += 1
        rep.account(self.now)
        rep.waiting.append(req)
        if req.adapter is not None:
            rep.wanting[req.adapter] = rep.wanting.get(req.adapter, 0) + 1
            rep.unplaced.pop(req.adapter, None)  # a waiting need now: the queue brings it in
        if rep.busy:
            # The prefetcher starts the load now; admission waits for the step boundary.
            if req.adapter is not None and req.adapter not in rep.slots:
                self._try_load(rep, req.adapter, req)
        else:
            self._schedule(rep)

    # -- prefetch hints -------------------------------------------------------------------------

    def _take_hint(self, rep: _Replica, adapter: str) -> None:
        """A hint reaches the replica's prefetcher: queue it, start the disk read, and place it
        (and any earlier hints still without a slot) if the rule allows."""
        c = self.config
        due = self.now
        if self.log is not None:
            self.log.append(LogEntry(due, "hint", rep.index, adapter, due=due))
        self._expire_hints(rep)
        if adapter in rep.hints:
            rep.hints[adapter] = min(rep.hints[adapter], due)
        else:
            if len(rep.hints) >= c.hint_capacity:
                latest = max(rep.hints, key=rep.hints.__getitem__)
                if rep.hints[latest] <= due:
                    return  # the new hint is the latest: it is the one dropped
                del rep.hints[latest]
                rep.unplaced.pop(latest, None)
            rep.hints[adapter] = due
        if adapter in rep.slots or rep.wanting.get(adapter):
            return  # resident, or a waiting request already brings it in
        rep.unplaced[adapter] = rep.hints[adapter]
        if adapter not in rep.host and len(rep.hints) <= c.host_capacity:
            self._read(rep, adapter)
        self._place_hints(rep)

    def _expire_hints(self, rep: _Replica) -> None:
        if self.now < rep.next_expiry:
            return
        rep.next_expiry = self.now + 1.0
        before = self.now - self.config.hint_ttl_s
        for adapter in [a for a, due in rep.hints.items() if due < before]:
            del rep.hints[adapter]
            rep.unplaced.pop(adapter, None)

    def _place_hints(self, rep: _Replica) -> None:
        """Give hinted adapters slots, soonest due first, stopping at the first that gets none.
        Nothing while a waiting request is blocked without a slot: it is needed sooner."""
        if not rep.unplaced or rep.starving_since != math.inf:
            return
        self._expire_hints(rep)
        for adapter, due in sorted(rep.unplaced.items(), key=lambda item: item[1]):
            victim = None
            if len(rep.slots) >= self.config.num_slots:
                victim = self._hint_victim(rep, due)
                if victim is None:
                    return
            self._load(rep, adapter, victim, hinted=True, due=due)

    def _hint_victim(self, rep: _Replica, due: float) -> str | None:
        """The idle slot whose next need is latest (never needed first, then least recently
        used), if that need is strictly later than `due`."""
        best: str | None = None
        best_need = -math.inf
        for adapter, slot in rep.slots.items():
            if slot.holds or not slot.ready or rep.wanting.get(adapter):
                continue
            need = rep.hints.get(adapter, math.inf)
            if need == math.inf:
                return adapter
            if need > best_need:
                best, best_need = adapter, need
        return best if best_need > due else None

    # -- adapter tiers ------------------------------------------------------------------------

    def _victim(self, rep: _Replica) -> str | None:
        """The slot to give up for a waiting request: the draining adapter once it is idle,
        else the least recently used idle one that no waiting request wants and no hint expects,
        else the idle hinted one due latest."""
        if rep.draining is not None:
            slot = rep.slots.get(rep.draining)
            if slot is not None and slot.holds == 0 and slot.ready:
                return rep.draining
        hinted: str | None = None
        for adapter, slot in rep.slots.items():
            if slot.holds == 0 and slot.ready and not rep.wanting.get(adapter):
                due = rep.hints.get(adapter)
                if due is None:
                    return adapter
                if hinted is None or due > rep.hints[hinted]:
                    hinted = adapter
        return hinted

    def _try_load(self, rep: _Replica, adapter: str, req: _Request) -> bool:
        """Give `adapter` a slot for a waiting request and start its load; False when no slot
        can be had."""
        victim = None
        if len(rep.slots) >= self.config.num_slots:
            victim = self._victim(rep)
            if victim is None:
                if rep.starving_since == math.inf:
                    rep.starving_since = req.reached
                return False
        self._load(rep, adapter, victim, hinted=False, due=req.reached)
        return True

    def _load(
        self, rep: _Replica, adapter: str, victim: str | None, *, hinted: bool, due: float
    ) -> None:
        """Evict `victim` (if any), give `adapter` its slot and start the disk read (when not
        in host memory) and the host→GPU copy."""
        c = self.config
        if victim is not None:
            slot = rep.slots[victim]
            if self.log is not None:
                self._log_load(rep, adapter, victim, slot.holds, hinted, due)
            if self.on_evict is not None:
                self.on_evict(rep.replica_id, victim, slot.holds)
            if slot.holds != 0 or not slot.ready:
                raise SimulationError(f"evicting {victim} with {slot.holds} holds")
            if hinted and (rep.wanting.get(victim) or rep.hints.get(victim, math.inf) <= due):
                raise SimulationError(f"a hint for {adapter} evicted {victim}, needed sooner")
            del rep.slots[victim]
            if rep.draining == victim:
                rep.draining = None
                rep.starving_since = math.inf
            if slot.hinted:
                self.hint_loads_wasted += 1
            if victim in rep.hints and not rep.wanting.get(victim):
                rep.unplaced[victim] = rep.hints[victim]  # still expected: place it again
        elif self.log is not None:
            self._log_load(rep, adapter, None, 0, hinted, due)
        if adapter in rep.slots:
            raise SimulationError(f"{adapter} given a second slot")
        rep.unplaced.pop(adapter, None)
        rep.slots[adapter] = _Slot(hinted)
        now = self.now
        on_host = rep.host.get(adapter)
        if on_host is None:
            on_host = self._read(rep, adapter)
        else:
            rep.host.move_to_end(adapter)
        done = rep.copy_free = max(now, on_host, rep.copy_free) + c.host_to_gpu_s
        self.loads += 1
        self.hint_loads += hinted
        self._push(done, _LOAD_DONE, (rep, adapter))

    def _read(self, rep: _Replica, adapter: str) -> float:
        """Queue a disk → host read; returns when the adapter will be in host memory."""
        c = self.config
        now = self.now
        start = max(now, rep.disk_free)
        on_host = rep.disk_free = start + c.disk_to_host_s
        self.disk_reads += 1
        rep.host[adapter] = on_host
        if len(rep.host) > c.host_capacity:
            for old, ready_at in rep.host.items():
                if ready_at <= now and old != adapter:
                    del rep.host[old]
                    break
        return on_host

    def _log_load(
        self, rep: _Replica, adapter: str, victim: str | None, holds: int, hinted: bool, due: float
    ) -> None:
        need = math.inf
        if victim is not None:
            # Found from the queue itself, not from the bookkeeping the rule uses.
            waits = [r.reached for r in rep.waiting if r.adapter == victim]
            need = min([*waits, rep.hints.get(victim, math.inf)])
        cause = "hint" if hinted else "demand"
        self.log.append(  # type: ignore[union-attr]
            LogEntry(self.now, "load", rep.index, adapter, None, cause, due, victim, holds, need)
        )

    # -- batching -----------------------------------------------------------------------------

    def _schedule(self, rep: _Replica) -> None:
        """At a step boundary: start loads for waiting requests and admit the ready ones, then
        run the next step if anything is running."""
        c = self.config
        if (
            rep.draining is None
            and rep.starving_since < self.now - c.starvation_s
            and len(rep.slots) >= c.num_slots
        ):
            held = [a for a, s in rep.slots.items() if s.holds > 0]
            if held:
                rep.draining = held[0]
        kept: list[_Request] = []
        room = c.max_num_seqs - rep.running
        scanned = 0
        blocked = False
        while rep.waiting and scanned < c.scan_limit:
            req = rep.waiting.popleft()
            scanned += 1
            a = req.adapter
            if a is None:
                if room > 0:
                    room -= 1
                    self._admit(rep, req, None)
                else:
                    kept.append(req)
                continue
            slot = rep.slots.get(a)
            if slot is None:
                if blocked or not self._try_load(rep, a, req):
                    blocked = True  # no slot for this one: later ones must not take it first
                kept.append(req)
            elif slot.ready and room > 0 and a != rep.draining:
                room -= 1
                self._admit(rep, req, slot)
            else:
                kept.append(req)
            if room == 0 and blocked:
                break
        rep.waiting.extendleft(reversed(kept))
        if not blocked:
            # Every request that wanted a slot got one: nothing starves, nothing need drain.
            rep.draining = None
            rep.starving_since = math.inf
        self._place_hints(rep)
        if rep.admitted or rep.running:
            new_tokens = sum(r.prompt for r in rep.admitted)
            batch = rep.running
            step_s = c.step_base_s + c.step_per_seq_s * batch + c.prefill_per_token_s * new_tokens
            rep.busy = True
            self._push(self.now + step_s, _STEP_END, rep)
        else:
            rep.busy = False

    def _admit(self, rep: _Replica, req: _Request, slot: _Slot | None) -> None:
        if slot is not None:
            slot.holds += 1
            slot.hinted = False
            req.adapter_wait = max(0.0, slot.ready_at - req.reached)
            rep.hints.pop(req.adapter, None)  # type: ignore[arg-type]
            rep.slots.move_to_end(req.adapter)  # type: ignore[arg-type]
            left = rep.wanting[req.adapter] - 1  # type: ignore[index]
            if left:
                rep.wanting[req.adapter] = left  # type: ignore[index]
            else:
                del rep.wanting[req.adapter]  # type: ignore[arg-type]
        rep.running += 1
        rep.admitted.append(req)
        # Admitted before step `rep.step + 1`: its tokens come at the ends of the next
        # `output` steps.
        heapq.heappush(rep.finishing, (rep.step + req.output, req.rid, req))

    def _step_end(self, rep: _Replica) -> None:
        now = self.now
        rep.step += 1
        for req in rep.admitted:
            req.ttft = now - req.arrival
        rep.admitted = []
        if rep.finishing and rep.finishing[0][0] <= rep.step:
            rep.account(now)
        while rep.finishing and rep.finishing[0][0] <= rep.step:
            _, _, req = heapq.heappop(rep.finishing)
            rep.running -= 1
            if req.adapter is not None:
                slot = rep.slots[req.adapter]
                slot.holds -= 1
                if slot.holds < 0:
                    raise SimulationError(f"{req.adapter} released more often than held")
            self.finished += 1
            router = self.routers[req.router]
            router.policy.on_finished(req.adapter, rep.replica_id)
            router.bump(rep.index, -1)
        max_ongoing = self.config.max_ongoing_requests
        while rep.held and rep.ongoing < max_ongoing:
            self._send(rep, rep.held.popleft())
        self._schedule(rep)

    # -- metrics ------------------------------------------------------------------------------

    def _result(self, wall_s: float) -> SimResult:
        reqs = self.requests[self.first_measured :]
        n = len(reqs)
        end = self.now
        for rep in self.replicas:
            rep.account(end)
        ttfts = sorted(r.ttft for r in reqs if not math.isnan(r.ttft))
        routed = [rep.routed for rep in self.replicas]
        span = end - self.measured_since
        queues = [rep.queue_area / span if span > 0 else 0.0 for rep in self.replicas]
        held = sum(1 for r in reqs if r.sent > r.arrival)
        per_1k = 1000 / n
        return SimResult(
            policy=self.policy_name,
            workload=self.config.workload.name,
            num_adapters=self.config.num_adapters,
            num_replicas=self.config.num_replicas,
            num_requests=n,
            finished=self.finished,
            sim_time_s=end,
            hit_rate=self.hits / n,
            loads_per_1k=1000 * self.loads / n,
            disk_reads_per_1k=1000 * self.disk_reads / n,
            imbalance_requests=_max_over_mean(routed),
            imbalance_queue=_max_over_mean(queues),
            ttft_p50_s=_quantile(ttfts, 0.50),
            ttft_p99_s=_quantile(ttfts, 0.99),
            throughput_rps=n / span if span > 0 else 0.0,
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
            adapter_wait_mean_s=sum(r.adapter_wait for r in reqs) / n,
            held_fraction=held / n,
            caller_wait_mean_s=sum(r.sent - r.arrival for r in reqs) / n,
            hints_per_1k=per_1k * self.hints_sent,
            hints_misdirected_per_1k=per_1k * self.hints_misdirected,
            hint_loads_per_1k=per_1k * self.hint_loads,
            hint_loads_wasted_per_1k=per_1k * self.hint_loads_wasted,
            wall_s=wall_s,
        )


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def simulate(config: SimConfig, make_policy: PolicyFactory, policy_name: str = "") -> SimResult:
    """Run one simulation; see `Simulation`."""
    return Simulation(config, make_policy, policy_name=policy_name).run()
