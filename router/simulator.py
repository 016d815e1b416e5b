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
shortest queue (Serve would hold it in the caller instead; the wait is similar).
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
    with weight 1/i^alpha), or "bursty" (`phases` equal spans, each a Zipf(alpha) over a fresh
    random ranking of the adapters, the arrival rate alternating × (1 - burst, 1 + burst)).
    """

    kind: str = "zipf"
    alpha: float = 1.0
    phases: int = 4
    burst: float = 0.25
    base_fraction: float = 0.0  # share of requests for the base model (adapter None)

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "zipf", "bursty"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
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
    hit_rate: float  # request found its adapter in a GPU slot (ready or loading) on arrival
    loads_per_1k: float  # host→GPU copies per 1,000 requests
    disk_reads_per_1k: float
    imbalance_requests: float  # max / mean of measured requests routed per replica
    imbalance_queue: float  # max / mean of time-averaged queue length per replica (measured)
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Requests and workload generation.


class _Request:
    __slots__ = ("rid", "adapter", "arrival", "prompt", "output", "router", "replica", "ttft")

    def __init__(self, rid: int, adapter: str | None, arrival: float, prompt: int, output: int):
        self.rid = rid
        self.adapter = adapter
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.router = 0
        self.replica = -1
        self.ttft = math.nan


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

    def zipf_weights(alpha: float) -> list[float]:
        return list(itertools.accumulate(1.0 / (i + 1) ** alpha for i in range(len(names))))

    phases = w.phases if w.kind == "bursty" else 1
    per_phase = math.ceil(n / phases)
    requests: list[_Request] = []
    t = 0.0
    for phase in range(phases):
        order = ranking()
        cum = None if w.kind == "uniform" else zipf_weights(w.alpha)
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
    __slots__ = ("holds", "ready")

    def __init__(self) -> None:
        self.holds = 0
        self.ready = False


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
        # metrics
        self.routed = 0
        self.queue_area = 0.0
        self.queue_t = 0.0

    @property
    def queue_len(self) -> int:
        return len(self.waiting) + self.running

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

    def queue_estimate(self, i: int) -> int:
        return max(0, self.queue_at_snapshot[i] - self.own_at_snapshot[i] + self.own[i])

    def refresh(self, replicas: list[_Replica], now: float, num_slots: int) -> None:
        for i, rep in enumerate(replicas):
            gpu = frozenset(a for a, s in rep.slots.items() if s.ready)
            loading = frozenset(a for a, s in rep.slots.items() if not s.ready)
            host = frozenset(a for a, ready_at in rep.host.items() if ready_at <= now)
            self.queue_at_snapshot[i] = rep.queue_len
            self.own_at_snapshot[i] = self.own[i]
            self.views[i] = ReplicaView(
                replica_id=rep.replica_id,
                gpu=gpu,
                loading=loading,
                host=host,
                num_slots=num_slots,
                free_slots=num_slots - len(rep.slots),
                queue_len=rep.queue_len,
            )

    def bump(self, i: int, delta: int) -> None:
        self.own[i] += delta
        self.views[i] = replace(self.views[i], queue_len=self.queue_estimate(i))

    def choose(self, adapter: str | None, max_ongoing: int) -> int:
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
                return best
        # No room anywhere: the first tier's shortest queue.
        return min((self.position[rid] for rid in tiers[0]), key=lambda i: self.views[i].queue_len)


# ---------------------------------------------------------------------------------------------

_ARRIVAL, _STEP_END, _LOAD_DONE, _SNAPSHOT = range(4)


class Simulation:
    """One run: `Simulation(config, make_policy).run()` → SimResult.

    `on_evict(replica_id, adapter, holds)` is called for every GPU-slot eviction, before it
    happens; the simulator itself raises SimulationError if `holds` is not 0 or the slot is still
    loading, so a hook may only observe."""

    def __init__(
        self,
        config: SimConfig,
        make_policy: PolicyFactory,
        *,
        policy_name: str = "",
        on_evict: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.config = config
        self.policy_name = policy_name
        self.on_evict = on_evict
        self.rng = random.Random(config.seed)
        self.requests = generate_requests(config, self.rng)
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
                self._arrive(payload)  # type: ignore[arg-type]
                nxt = next(arrivals, None)
                if nxt is not None:
                    self._push(nxt.arrival, _ARRIVAL, nxt)
            elif kind == _STEP_END:
                self._step_end(payload)  # type: ignore[arg-type]
            elif kind == _LOAD_DONE:
                rep, adapter = payload  # type: ignore[misc]
                rep.slots[adapter].ready = True
                if not rep.busy:
                    self._schedule(rep)
            else:
                router = payload
                router.refresh(self.replicas, t, c.num_slots)  # type: ignore[union-attr]
                self._push(t + c.stats_period_s, _SNAPSHOT, router)
        return self._result(time.perf_counter() - wall)

    # -- routing ------------------------------------------------------------------------------

    def _start_measuring(self) -> None:
        self.hits = self.loads = self.disk_reads = 0
        for rep in self.replicas:
            rep.account(self.now)
            rep.routed = 0
            rep.queue_area = 0.0
        self.measured_since = self.now

    def _arrive(self, req: _Request) -> None:
        c = self.config
        if req.rid == self.first_measured:
            self._start_measuring()
        router = self.routers[self.rng.randrange(len(self.routers))]
        req.router = router.index
        i = router.choose(req.adapter, c.max_ongoing_requests)
        router.policy.on_routed(req.adapter, router.ids[i])
        router.bump(i, +1)
        rep = self.replicas[i]
        req.replica = i
        rep.routed += 1
        if req.adapter is None or req.adapter in rep.slots:
            self.hits += 1
        rep.account(self.now)
        rep.waiting.append(req)
        if req.adapter is not None:
            rep.wanting[req.adapter] = rep.wanting.get(req.adapter, 0) + 1
        if rep.busy:
            # The prefetcher starts the load now; admission waits for the step boundary.
            if req.adapter is not None and req.adapter not in rep.slots:
                self._try_load(rep, req.adapter, req)
        else:
            self._schedule(rep)

    # -- adapter tiers ------------------------------------------------------------------------

    def _victim(self, rep: _Replica) -> str | None:
        """The slot to give up: the draining adapter once it is idle, else the least recently
        used idle one that no waiting request wants."""
        if rep.draining is not None:
            slot = rep.slots.get(rep.draining)
            if slot is not None and slot.holds == 0 and slot.ready:
                return rep.draining
        for adapter, slot in rep.slots.items():
            if slot.holds == 0 and slot.ready and not rep.wanting.get(adapter):
                return adapter
        return None

    def _try_load(self, rep: _Replica, adapter: str, req: _Request) -> bool:
        """Give `adapter` a slot and start its load; False when no slot can be had."""
        c = self.config
        if len(rep.slots) >= c.num_slots:
            victim = self._victim(rep)
            if victim is None:
                if rep.starving_since == math.inf:
                    rep.starving_since = req.arrival
                return False
            slot = rep.slots[victim]
            if self.on_evict is not None:
                self.on_evict(rep.replica_id, victim, slot.holds)
            if slot.holds != 0 or not slot.ready:
                raise SimulationError(f"evicting {victim} with {slot.holds} holds")
            del rep.slots[victim]
            if rep.draining == victim:
                rep.draining = None
                rep.starving_since = math.inf
        rep.slots[adapter] = _Slot()
        now = self.now
        on_host = rep.host.get(adapter)
        if on_host is None:
            start = max(now, rep.disk_free)
            on_host = rep.disk_free = start + c.disk_to_host_s
            self.disk_reads += 1
            rep.host[adapter] = on_host
            if len(rep.host) > c.host_capacity:
                for old, ready_at in rep.host.items():
                    if ready_at <= now and old != adapter:
                        del rep.host[old]
                        break
        else:
            rep.host.move_to_end(adapter)
        done = rep.copy_free = max(now, on_host, rep.copy_free) + c.host_to_gpu_s
        self.loads += 1
        self._push(done, _LOAD_DONE, (rep, adapter))
        return True

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
