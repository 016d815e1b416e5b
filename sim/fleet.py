"""A fleet on the virtual clock: engine replicas (`sim.replica`) behind Serve's controller and
one or more routers (`sim.serve`), fed a workload (`sim.workload`); `Fleet(...).run()` returns
the serving benchmark's figures (`FleetResult`, the keys of benchmarks/bench_router_serve.py's
rows).

Between the client and the engine: a request reaches its router `overhead_s / 2` after the
client sends it (HTTP, the proxy and the ingress), and each token reaches the client
`rpc_s + overhead_s / 2` after the engine samples it. Under Serve every engine step takes
`served_step_s` longer than the calibration's (measured in-process): the step thread shares its
process, and its GIL, with the replica's event loop and Ray's threads.

A replica that dies aborts every request on it (they count as failed) and the controller drops
it at once; routers learn of it at the next broadcast, or sooner when a send to it fails. A
replica that joins is broadcast the same way.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from replicas.request import Request, RequestStatus
from router.queue_lengths import QueueLengthFeed
from sim.calibration import DEFAULT, Calibration
from sim.events import EventLoop
from sim.replica import ReplicaConfig, SimReplica, make_request
from sim.serve import (
    AffinityChoice,
    Choice,
    Controller,
    Pow2Choice,
    Router,
    ServeConfig,
    SimHints,
    SimRequest,
)
from sim.workload import Arrival, Workload

ROUTERS = ("affinity+hints", "affinity", "pow2")


@dataclass(frozen=True)
class FleetConfig:
    num_replicas: int = 2
    router: str = "affinity"  # one of ROUTERS
    num_routers: int = 1  # caller handles (ingress replicas), requests spread at random
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    overhead_s: float = 0.0  # client <-> router, both ways together (HTTP, proxy, ingress)
    served_step_s: float = 0.0  # added to every engine step (a Serve replica's, not in-process)
    policy_kwargs: tuple[tuple[str, Any], ...] = ()  # AffinityPolicy's, as sorted items
    seed: int = 0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose from {ROUTERS}")
        if self.num_replicas < 1 or self.num_routers < 1:
            raise ValueError("need at least one replica and one router")
        if self.overhead_s < 0 or self.served_step_s < 0:
            raise ValueError("the served path cannot take negative time")


@dataclass(frozen=True)
class FleetEvent:
    """At `t` (seconds on the clock), `kind` "kill" replica number `replica`, or "add" one."""

    t: float
    kind: str
    replica: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("kill", "add") or (self.kind == "kill" and self.replica is None):
            raise ValueError(f"bad fleet event {self}")


@dataclass
class FleetResult:
    """The measured part of a run, as benchmarks/bench_router_serve.py reports it."""

    router: str
    workload: str
    sent: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    # Gaps between a request's tokens as its replica samples them (the client gets them in
    # 50 ms chunks and gives each token its chunk's mean gap: a P50 within 0.1 ms of this).
    itl_p50_ms: float
    e2e_p50_s: float
    adapter_wait_mean_ms: float
    hit_rate: float
    loads_per_1k: float
    disk_reads_per_1k: float
    prefetch_loads: int
    admissions: int
    requests_per_replica: list[float]  # adapter requests finished, per replica (id order)
    imbalance: float  # max / mean of requests_per_replica
    gpu_copies: float | None  # replicas holding an adapter on GPU (or loading), mean
    memory_copies: float | None  # replicas holding it anywhere in memory, mean
    duration_s: float
    hints_sent: int = 0
    retries: int = 0  # sends a replica turned away (max_ongoing_requests) or that failed
    starved: int = 0  # measured requests never finished
    max_wait_s: float = 0.0  # the longest TTFT, seconds
    # Adapter requests whose adapter was in a GPU slot of their replica when they got there.
    # The engines' hit rate counts slots the prefetcher filled from the waiting queue, so it
    # stays near 1 however requests are placed; this one says what the placement found.
    arrival_hit_rate: float = math.nan
    request_throughput: float = math.nan  # completed requests / duration_s
    throughput_tok_s: float = math.nan  # output tokens of completed requests / duration_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Replica:
    """A replica: its engine, and the Serve actor's count of ongoing requests."""

    engine: SimReplica
    ongoing: int = 0
    published: tuple[tuple[str, ...], ...] | None = None
    finished_adapter: int = 0  # measured adapter requests finished here


@dataclass
class _Counters:
    gpu_loads: int = 0
    disk_reads: int = 0
    prefetch_loads: int = 0
    hits: int = 0
    misses: int = 0


class Fleet:
    def __init__(
        self,
        config: FleetConfig,
        workload: Workload,
        cal: Calibration = DEFAULT,
        events: Sequence[FleetEvent] = (),
    ) -> None:
        self.config = config
        self.workload = workload
        step = cal.step
        self.cal = replace(cal, step=replace(step, base_s=step.base_s + config.served_step_s))
        self.loop = EventLoop()
        self.rng = random.Random(config.seed)
        self.controller = Controller(self.loop, config.serve)
        self.replicas: dict[str, _Replica] = {}
        self._retired: list[_Replica] = []
        self._by_engine: dict[str, tuple[SimRequest, Router, str]] = {}
        self._hints: list[SimHints] = []
        # Routers start with their first request and connect then (`Controller.connect`).
        self.routers = [self._router(i) for i in range(config.num_routers)]
        for _ in range(config.num_replicas):
            self._add_replica()
        self.loop.after(config.serve.stats_period_s, self._poll_stats)
        for event in events:
            self.loop.at(event.t, self._event, event)
        self.requests: list[SimRequest] = []
        self._pending_warmup = len(workload.warmup)
        self._pending_measured = len(workload.measured)
        self._measure_start: _Counters | None = None
        self._measure_t = math.nan
        self._end_t = math.nan
        self._last_token: dict[str, float] = {}  # engine request id -> its latest token's time
        self._token_gaps: list[float] = []  # measured requests', seconds
        self.retries = 0

    # -- construction ---------------------------------------------------------------------------

    def _router(self, index: int) -> Router:
        c = self.config
        rng = random.Random(self.rng.getrandbits(64))
        choice: Choice
        if c.router == "pow2":
            choice = Pow2Choice(rng, c.serve)
        else:
            hints = None
            if c.router == "affinity+hints" and c.replica.prefetch:
                hints = SimHints(self.loop, self, c.serve)
                self._hints.append(hints)
            choice = AffinityChoice(
                hints,
                num_slots=c.replica.max_loras_per_batch,
                policy_kwargs=dict(c.policy_kwargs),
                clock=self.loop.now,
            )
        feed = None if c.router == "pow2" else QueueLengthFeed()
        return Router(
            f"router-{index}", self.loop, self, choice, c.serve, rng, self.controller, feed
        )

    def _add_replica(self) -> str:
        index = len(self.replicas) + len(self._retired)
        rid = f"replica-{index:03d}"
        engine = SimReplica(
            rid, self.loop, self.cal, self.config.replica, self._on_token, self._on_done
        )
        self.replicas[rid] = _Replica(engine)
        self.controller.add_replica(rid)
        # Each replica's residency check runs on its own phase.
        period = self.config.serve.push_period_s
        self.loop.after(self.rng.uniform(0, period), self._publish, rid)
        return rid

    def _event(self, event: FleetEvent) -> None:
        if event.kind == "add":
            self._add_replica()
            return
        rid = f"replica-{event.replica:03d}"
        replica = self.replicas.pop(rid, None)
        if replica is None:
            return
        self._retired.append(replica)
        self.controller.remove_replica(rid)
        replica.engine.kill()

    # -- replica side ---------------------------------------------------------------------------

    def _stats(self, replica: _Replica) -> dict[str, Any]:
        """replicas/deployment/stats.py `routing_stats_dict`: the engine's RoutingStats as JSON."""
        s = replica.engine.routing_stats()
        return {
            "gpu": list(s.gpu),
            "loading": list(s.loading),
            "host": list(s.host),
            "num_slots": s.num_slots,
            "free_slots": s.free_slots,
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
        }

    def _publish(self, rid: str) -> None:
        """`EngineDeployment.publish_residency`: when the adapters on GPU, loading or in host
        memory changed, push the GPU and loading ones as multiplexed ids, with the stats."""
        replica = self.replicas.get(rid)
        if replica is None:
            return
        stats = self._stats(replica)
        residency = tuple(tuple(sorted(stats[tier])) for tier in ("gpu", "loading", "host"))
        if residency != replica.published:
            replica.published = residency
            self.controller.record(rid, residency[0] + residency[1], stats)
        self.loop.after(self.config.serve.push_period_s, self._publish, rid)

    def _poll_stats(self) -> None:
        """The controller's `record_routing_stats` poll of every replica."""
        for rid, replica in self.replicas.items():
            self.controller.record(rid, stats=self._stats(replica))
        if not self._done():
            self.loop.after(self.config.serve.stats_period_s, self._poll_stats)

    # -- Endpoint (what routers reach) ----------------------------------------------------------

    def probe(self, replica_id: str) -> int | None:
        replica = self.replicas.get(replica_id)
        return None if replica is None else replica.ongoing

    def deliver(self, request: SimRequest, replica_id: str, router: Router) -> None:
        rpc = self.config.serve.rpc_s
        replica = self.replicas.get(replica_id)
        if replica is None:
            self.retries += 1
            self.loop.after(rpc, router.on_send_failed, request, replica_id)
            return
        if replica.ongoing >= self.config.serve.max_ongoing_requests:
            self.retries += 1
            self.loop.after(rpc, router.on_reply, request, replica_id, False, replica.ongoing)
            return
        replica.ongoing += 1
        engine_request = make_request(
            f"{request.rid}#{request.attempts}",
            request.adapter,
            request.prompt_tokens,
            request.output_tokens,
            self.loop.now(),
        )
        request.engine = engine_request
        self._by_engine[engine_request.request_id] = (request, router, replica_id)
        replica.engine.submit(engine_request)
        self.loop.after(rpc, router.on_reply, request, replica_id, True, replica.ongoing)

    def hint(self, replica_id: str, adapter: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.engine.prefetch_hint(adapter)

    def _on_token(self, engine_request: Request, first: bool) -> None:
        request, _, _ = self._by_engine[engine_request.request_id]
        now = self.loop.now()
        if first:
            request.first_token_at = now + self._back_s
        elif request.measured:
            self._token_gaps.append(now - self._last_token[engine_request.request_id])
        self._last_token[engine_request.request_id] = now

    def _on_done(self, engine_request: Request) -> None:
        request, router, rid = self._by_engine.pop(engine_request.request_id)
        self._last_token.pop(engine_request.request_id, None)
        replica = self.replicas.get(rid) or next(
            r for r in self._retired if r.engine.replica_id == rid
        )
        replica.ongoing -= 1
        request.finished_at = self.loop.now() + self._back_s
        if engine_request.status is not RequestStatus.FINISHED_LENGTH:
            request.failed = True
        elif request.measured and request.adapter is not None:
            replica.finished_adapter += 1
        self.loop.after(self.config.serve.rpc_s, router.on_completed, request, rid)
        if request.measured:
            self._pending_measured -= 1
            if self._pending_measured == 0:
                self._end_t = self.loop.now()
                self._end = self._counters()
        else:
            self._pending_warmup -= 1
            if self._pending_warmup == 0 and self.workload.gap_s is not None:
                self.loop.after(self.workload.gap_s, self._start_measured)

    @property
    def _back_s(self) -> float:
        return self.config.serve.rpc_s + self.config.overhead_s / 2

    # -- the client -----------------------------------------------------------------------------

    def _send(self, arrival: Arrival, measured: bool) -> None:
        index = len(self.requests)
        request = SimRequest(
            rid=f"req-{index}",
            adapter=arrival.adapter,
            prompt_tokens=arrival.prompt,
            output_tokens=arrival.output,
            created_at=self.loop.now(),
            measured=measured,
        )
        self.requests.append(request)
        router = self.routers[self.rng.randrange(len(self.routers))]
        self.loop.after(self.config.overhead_s / 2, router.submit, request)

    def _start_measured(self) -> None:
        self._measure_t = self.loop.now()
        self._measure_start = self._counters()
        for arrival in self.workload.measured:
            self.loop.after(arrival.t, self._send, arrival, True)

    def _mark_measured(self) -> None:
        self._measure_t = self.loop.now()
        self._measure_start = self._counters()

    def _counters(self) -> _Counters:
        out = _Counters()
        for replica in [*self.replicas.values(), *self._retired]:
            a = replica.engine.adapters
            out.gpu_loads += a.gpu_loads
            out.disk_reads += a.disk_reads
            out.prefetch_loads += a.prefetch_loads
            out.hits += a.hits
            out.misses += a.misses
        return out

    def _done(self) -> bool:
        return self._pending_measured == 0

    # -- run ------------------------------------------------------------------------------------

    def run(self, max_t: float = 3600.0) -> FleetResult:
        w = self.workload
        for arrival in w.warmup:
            self.loop.at(arrival.t, self._send, arrival, False)
        if w.gap_s is None:
            self.loop.at(w.measured[0].t, self._mark_measured)
            for arrival in w.measured:
                self.loop.at(arrival.t, self._send, arrival, True)
        elif not w.warmup:
            self.loop.at(0.0, self._start_measured)
        self.loop.run(until=self._done, max_t=max_t)
        if not self._done():
            self._end_t = self.loop.now()
            self._end = self._counters()
        return self._result()

    def _result(self) -> FleetResult:
        start = self._measure_start or _Counters()
        end = self._end
        grown = {k: getattr(end, k) - getattr(start, k) for k in asdict(start)}
        measured = [r for r in self.requests if r.measured]
        ok = [r for r in measured if not r.failed and not math.isnan(r.finished_at)]
        ttfts = sorted(r.ttft_s for r in ok)  # created when the client sent it
        e2e = sorted(r.finished_at - r.created_at for r in ok)
        waits = [r.engine.adapter_wait_s for r in ok if r.adapter is not None]
        admissions = grown["hits"] + grown["misses"]
        every = sorted([*self.replicas.values(), *self._retired], key=lambda r: r.engine.replica_id)
        per_replica = [float(r.finished_adapter) for r in every]
        served = sum(per_replica)
        completed = len(ok)
        per_1k = (lambda n: 1000.0 * n / completed) if completed else (lambda n: math.nan)
        gpu, memory = self._placement()
        adapter_ok = [r for r in ok if r.adapter is not None and r.engine is not None]
        duration = self._end_t - self._measure_t
        return FleetResult(
            router=self.config.router,
            workload=self.workload.name,
            sent=len(measured),
            completed=completed,
            failed=sum(r.failed for r in measured),
            ttft_p50_ms=1000 * _quantile(ttfts, 0.50),
            ttft_p99_ms=1000 * _quantile(ttfts, 0.99),
            itl_p50_ms=1000 * _quantile(sorted(self._token_gaps), 0.50),
            e2e_p50_s=_quantile(e2e, 0.50),
            adapter_wait_mean_ms=1000 * sum(waits) / len(waits) if waits else 0.0,
            hit_rate=grown["hits"] / admissions if admissions else math.nan,
            loads_per_1k=per_1k(grown["gpu_loads"]),
            disk_reads_per_1k=per_1k(grown["disk_reads"]),
            prefetch_loads=grown["prefetch_loads"],
            admissions=admissions,
            requests_per_replica=per_replica,
            imbalance=max(per_replica) / (served / len(per_replica)) if served else math.nan,
            gpu_copies=gpu,
            memory_copies=memory,
            duration_s=duration,
            hints_sent=sum(h.num_sent for h in self._hints),
            retries=self.retries,
            starved=sum(1 for r in measured if math.isnan(r.finished_at)),
            max_wait_s=ttfts[-1] if ttfts else math.nan,
            arrival_hit_rate=(
                sum(not r.engine.cold_adapter for r in adapter_ok) / len(adapter_ok)
                if adapter_ok
                else math.nan
            ),
            request_throughput=completed / duration if duration > 0 else math.nan,
            throughput_tok_s=(
                sum(r.output_tokens for r in ok) / duration if duration > 0 else math.nan
            ),
        )

    def _placement(self) -> tuple[float | None, float | None]:
        """bench_router_serve.placement: over the adapters some replica holds, the mean number
        of replicas holding each on GPU (or loading) and in memory at all."""
        on_gpu: dict[str, int] = {}
        in_memory: dict[str, int] = {}
        for replica in self.replicas.values():
            tiers = replica.engine.adapters.residency()
            for name in tiers["gpu"] + tiers["loading"]:
                on_gpu[name] = on_gpu.get(name, 0) + 1
            for name in tiers["gpu"] + tiers["loading"] + tiers["host"]:
                in_memory[name] = in_memory.get(name, 0) + 1
        mean = lambda d: sum(d.values()) / len(d) if d else None
        return mean(on_gpu), mean(in_memory)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as loadgen's summaries)."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def simulate(
    config: FleetConfig,
    workload: Workload,
    cal: Calibration = DEFAULT,
    events: Sequence[FleetEvent] = (),
) -> FleetResult:
    return Fleet(config, workload, cal, events).run()


def compare(
    workload: Workload,
    cal: Calibration = DEFAULT,
    routers: Sequence[str] = ROUTERS,
    **config: Any,
) -> Mapping[str, FleetResult]:
    """The same workload under each router, same seed."""
    return {r: simulate(FleetConfig(router=r, **config), workload, cal) for r in routers}
