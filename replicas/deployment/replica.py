"""`EngineDeployment`: the Ray Serve deployment that wraps one engine replica."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

from ray import serve

from replicas import engine_calls, hop_log
from replicas.adapter_ledger import AdapterEntry, LedgerStore, LoadMismatch, Superseded
from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.deployment import ray_runtime
from replicas.deployment.ledger import fleet_ledger
from replicas.deployment.liveness import GcsLiveness
from replicas.deployment.metrics import EngineMetrics
from replicas.deployment.stats import ReplicaStats, routing_stats_dict, served_adapters_dict
from replicas.engine import Engine, RequestRejected
from replicas.engine_core import build_core
from replicas.engine_loop import EngineStopped
from replicas.engine_stats import RoutingStats
from replicas.errors import ErrorKind
from replicas.leases import CallerLeases
from replicas.protocol import EngineError, GenerateChunk, GenerateRequest

logger = logging.getLogger("ray.serve")

STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 0.5
RESIDENCY_PERIOD_S = 0.1  # how often a replica checks whether its adapter residency changed
LEDGER_SYNC_S = 5.0  # how often a replica catches up with the runtime adapter ledger
# How long a caller counts as alive before it is asked after again: a dead caller's requests
# are aborted within LEASE_S + LEASE_SWEEP_S of its death (plus the GCS's own notice, ~20 ms,
# and its answer). A live caller's requests are never aborted, however late the answer.
LEASE_S = 0.5
CHANNEL_IDLE_S = 1.0  # a caller's channel with nothing to send for this long ends (a draining
# replica waits for it: Serve counts it as an ongoing request)
LEASE_SWEEP_S = 0.25  # how often a replica looks for callers whose lease lapsed
CALLERS_KEPT = 64  # callers whose last request's end `stats()` reports (and dead ones kept)
ABANDONED = "the request's caller went away"


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=10)
class EngineDeployment:
    """One engine replica. `prepare` runs first on the replica's node (it makes sure the model
    files exist there, e.g. building the embedded demo); `engine_cls` and `metrics` are
    injectable for tests. The engine runs on a thread of the replica, or in a process of its own
    (`config.engine_process`); either way it is reached only through `self.engine.call` with
    the module-level functions of `replicas.engine_calls` (or the engine's own methods). When
    built inside an event loop (as Serve does), a background task turns the engine's stats into
    metrics every `stats_period_s`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        prepare: Callable[[], object] | None = None,
        engine_cls: type[Engine] = Engine,
        metrics: EngineMetrics | None = None,
        stats_period_s: float = STATS_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        ledger: LedgerStore | None = None,
        dead_callers: Callable[[list[str]], Awaitable[set[str]]] | None = None,
    ) -> None:
        if prepare is not None:
            prepare()
        self.config = config
        self.replica_id = ray_runtime.replica_id()
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.metrics.set_slot_capacity(config.max_loras_per_batch)
        self.leases = CallerLeases(clock, dead_kept=CALLERS_KEPT)
        # Which callers (ingress replicas' actor ids) are known dead: asked only of callers whose
        # lease lapsed, so a live ingress sends nothing to keep its requests.
        self._serve = ray_runtime.serve_context()
        if dead_callers is None and self._serve is not None:
            dead_callers = GcsLiveness()
        self._dead_callers = dead_callers
        self.num_abandoned = 0  # requests aborted because their caller's lease lapsed
        self.abandoned_at: float | None = None  # wall clock (time.time) of the last of them
        # caller -> wall clock when its last live request here ended (the newest CALLERS_KEPT)
        self.caller_done_at: dict[str, float] = {}
        # Adapters loaded and unloaded at run time, kept by the fleet (replicas/adapter_ledger.py):
        # caught up with before the engine's first step, then every LEDGER_SYNC_S. Its follower
        # lives beside the engine (`engine_calls.follower`).
        self.ledger = ledger if ledger is not None else fleet_ledger(self._serve)
        entries = self.ledger.read_all() if self.ledger is not None else {}
        setup = partial(engine_calls.follow_ledger, entries=entries) if entries else None
        core, followed = build_core(config, engine_cls, setup)
        if followed is not None:
            self._log_followed(*followed, entries)
        self.engine = AsyncEngine(core, config.stream_interval_s, config.max_stream_chunks_per_s)
        self.engine.start()
        self._stats_task: asyncio.Task | None = None
        self._lease_task: asyncio.Task | None = None
        self._ledger_task: asyncio.Task | None = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # built outside Serve: `report_stats()` is called by hand
        if loop is not None:
            self._stats_task = loop.create_task(
                _every(stats_period_s, self.report_stats, "reading engine stats for metrics")
            )
            self._lease_task = loop.create_task(
                _every(LEASE_SWEEP_S, self.abort_abandoned, "aborting abandoned requests")
            )
            if self.ledger is not None:
                self._ledger_task = loop.create_task(
                    _every(LEDGER_SYNC_S, self.sync_adapters, "catching up with the ledger")
                )
        self._routing_stats: RoutingStats | None = None  # the last answer, for slow engines
        self._published: _Residency | None = None  # residency last pushed to Serve
        self._routing_tasks: list[asyncio.Task] = []
        if loop is not None and self._serve is not None:
            self._routing_tasks = [
                loop.create_task(
                    _every(RESIDENCY_PERIOD_S, self.publish_residency, "publishing residency")
                ),
                loop.create_task(self._follow_hints()),
            ]
        logger.info("engine replica ready on %s with model %s", config.device, config.model)

    async def generate(
        self, request: GenerateRequest, caller: str | None = None, lease_s: float = LEASE_S
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks. `caller` (the sending ingress's Ray actor id) makes the
        request that caller's: once the caller's lease lapses (`lease_s` after its last request
        or its last answer as alive) it is asked after, and its requests are aborted only if it
        is dead (`abort_abandoned`)."""
        hop_log.stamp("engine_in")
        if caller is not None and self.leases.is_dead(caller):  # it reached us late: refused
            self._abandoned(request.request_id, caller)
            error = EngineError(ABANDONED, ErrorKind.UNAVAILABLE)
            yield GenerateChunk(request.request_id, finish_reason="error", error=error)
            return
        if caller is not None:
            self.leases.track(request.request_id, caller, lease_s)
        first = True
        try:
            async for chunk in self.engine.generate(request, caller):
                if chunk.metrics is not None:
                    self.metrics.request_finished(request.adapter is not None, chunk.metrics)
                if first:  # where the caller may open a channel (`channel`)
                    hop_log.stamp("engine_first")
                    chunk = replace(chunk, replica_id=self.replica_id)
                    first = False
                yield chunk
        finally:
            self.leases.release(request.request_id)
            if caller is not None and not self.leases.owns(caller):
                self._caller_done(caller)

    async def channel(
        self, caller: str, replica_id: str, idle_s: float = CHANNEL_IDLE_S
    ) -> AsyncIterator[list[GenerateChunk]]:
        """`caller`'s channel on this replica: an empty batch at once (open), then batches of
        its requests' chunks between their first and last, one batch an interval for all of
        them (`replicas.async_engine.Channel`). Routed here by `replica_id` (the router pins the
        call); a replica reached by mistake yields nothing and ends. Ends after `idle_s` with
        nothing to send, and when the caller is found dead; what it holds then goes back to
        the requests' own streams."""
        if replica_id != self.replica_id or self.leases.is_dead(caller):
            return
        channel = self.engine.open_channel(caller)
        try:
            yield []
            async for batch in channel.batches(idle_s):
                yield batch
        finally:
            self.engine.close_channel(channel)

    def _caller_done(self, caller: str) -> None:
        self.caller_done_at.pop(caller, None)
        self.caller_done_at[caller] = time.time()
        while len(self.caller_done_at) > CALLERS_KEPT:
            del self.caller_done_at[next(iter(self.caller_done_at))]

    async def abort_abandoned(self) -> None:
        """Every `LEASE_SWEEP_S` under Serve: the callers whose lease lapsed are asked after
        (Ray's GCS knows whether an actor is dead). Those found dead lose their requests, since
        no one would close their streams; every other one (alive, or not known dead: the GCS
        was slow or failed) keeps them and is asked again a lease later. Built outside Serve
        (no liveness check), no request is ever abandoned."""
        lapsed = self.leases.lapsed_callers()
        if not lapsed or self._dead_callers is None:
            return
        dead = await self._dead_callers(lapsed)
        for caller in lapsed:
            if caller not in dead:
                self.leases.renew(caller, LEASE_S)
                continue
            for request_id in self.leases.abandon(caller):
                self._abandoned(request_id, caller)
                self.engine.abort(request_id, ABANDONED)
            self.engine.drop_channel(caller)
            self._caller_done(caller)

    def _abandoned(self, request_id: str, caller: str) -> None:
        self.num_abandoned += 1
        self.abandoned_at = time.time()
        logger.warning("aborting request %s: its caller %s is dead", request_id, caller)

    async def info(self) -> dict:
        return await self.engine.call(engine_calls.engine_info)

    async def stats(self) -> dict[str, Any]:
        """This replica's `ReplicaStats` as the dict other processes read: the engine's
        `EngineStats` fields, then `num_held_slots`, `num_aborted`, `step_cpu_s`, `callers`,
        `caller_done_at`, `num_abandoned` and `abandoned_at`."""
        return (await self._snapshot()).to_dict()

    async def replica_stats(self) -> dict[str, Any]:
        """`stats()` with this replica's id, for readings gathered from every replica."""
        return {"replica_id": self.replica_id, **await self.stats()}

    async def slowest_steps(
        self, since_step: dict[str, int], count: int = engine_calls.SLOWEST_STEPS
    ) -> dict[str, Any]:
        """This replica's slowest steps after step number `since_step[replica id]` (0 when it
        is not named), for readings gathered from every replica (`engine_calls.slowest_steps`)."""
        since = int(since_step.get(self.replica_id, 0))
        steps = await self.engine.call(engine_calls.slowest_steps, since, int(count))
        return {"replica_id": self.replica_id, "steps": steps}

    async def _snapshot(self) -> ReplicaStats:
        engine_stats, num_held_slots = await self.engine.call(engine_calls.read_engine)
        return ReplicaStats(
            engine=engine_stats,
            num_held_slots=num_held_slots,
            num_aborted=self.engine.num_aborted,
            step_cpu_s=self.engine.step_cpu_s,
            callers=self.leases.callers(),
            caller_done_at=dict(self.caller_done_at),
            num_abandoned=self.num_abandoned,
            abandoned_at=self.abandoned_at,
        )

    async def report_stats(self) -> None:
        """Read the engine's stats once into the metrics."""
        self.metrics.update(await self.engine.call(Engine.stats))

    # -- adapters ------------------------------------------------------------------------------

    async def load_adapter(
        self,
        name: str,
        path: str,
        pinned: bool = False,
        load_id: str | None = None,
        version: int | None = None,
    ) -> None:
        """Raises RequestRejected (with its `kind`) for a bad adapter or a name in use. `load_id`
        marks this load, so that undoing it (`unload_adapter(name, load_id)`) never removes an
        adapter of the same name that another load registered. `version` is the ledger
        version of this change (an older ledger entry never undoes it)."""
        await self.engine.call(engine_calls.load_adapter, name, path, pinned, load_id, version)

    async def unload_adapter(
        self, name: str, load_id: str | None = None, version: int | None = None
    ) -> None:
        """New requests for `name` are refused (NOT_FOUND); queued and running ones finish. With
        `load_id`, only when that load is what registered `name` here. Raises RequestRejected
        NOT_FOUND otherwise, or when `name` is not loaded. An unload of a `version` this replica
        already applied from the ledger succeeds."""
        try:
            await self.engine.call(engine_calls.unload_adapter, name, load_id, version)
        except (LoadMismatch, Superseded) as e:
            raise RequestRejected.of(e) from e

    async def sync_adapters(self) -> list[str]:
        """Catch up with the ledger (every `LEDGER_SYNC_S` under Serve): load and unload what
        changed since this replica last applied each name. Returns the names changed here."""
        if self.ledger is None:
            return []
        entries = await asyncio.to_thread(self.ledger.read_all)
        changed, failures = await self.engine.call(engine_calls.follow_ledger, entries)
        self._log_followed(changed, failures, entries)
        return changed

    def _log_followed(
        self, changed: list[str], failures: dict[str, str], entries: dict[str, AdapterEntry]
    ) -> None:
        """What a catch-up with the ledger did (`engine_calls.follow_ledger`), in this replica's
        log."""
        for name in changed:
            logger.info("adapter %s %s from the ledger", name, entries[name].path or "unloaded")
        for name, reason in failures.items():
            logger.warning("could not apply the ledger's entry for adapter %s: %s", name, reason)

    async def adapters(self) -> dict[str, dict]:
        return await self.engine.call(Engine.adapter_status)

    async def adapter_report(self, timeout_s: float) -> dict[str, Any]:
        """`adapters()` with this replica's id, for listings gathered from every replica:
        `{"replica_id", "adapters": {...} | None, "error": str | None}`. The engine answers
        between steps; one that takes longer than `timeout_s` gets `adapters` None."""
        try:
            adapters = await asyncio.wait_for(self.adapters(), timeout_s)
        except TimeoutError:
            return {
                "replica_id": self.replica_id,
                "adapters": None,
                "error": f"the engine did not answer within {timeout_s:g} s",
            }
        return {"replica_id": self.replica_id, "adapters": adapters, "error": None}

    async def served_adapters(self) -> dict[str, Any]:
        """What new requests may name here: `{"adapters": {name: path}, "unloaded": [name]}`,
        the adapters registered by name (configured or loaded at run time) and the names
        unloaded (adapter_root folders included)."""
        return served_adapters_dict(await self.engine.call(Engine.served_adapters))

    async def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        self.engine.hint([(adapter, eta_s)])

    # -- routing -------------------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router places requests by, polled by Serve's controller every
        `request_routing_stats_period_s`: `{"gpu", "loading", "host": [adapter], "num_slots",
        "free_slots", "num_waiting", "num_running"}`. The engine answers between steps; when it
        takes longer than `ROUTING_STATS_TIMEOUT_S`, the previous answer (or an empty one) is
        returned rather than holding the controller up."""
        stats = await self._read_routing_stats()
        return routing_stats_dict(stats) if stats is not None else {}

    async def _read_routing_stats(self) -> RoutingStats | None:
        try:
            stats = await asyncio.wait_for(
                self.engine.call(Engine.routing_stats), ROUTING_STATS_TIMEOUT_S
            )
        except TimeoutError:
            return self._routing_stats
        self._routing_stats = stats
        return stats

    async def publish_residency(self) -> None:
        """When the adapters on GPU, loading or in host memory changed, push them to Serve's
        controller at once rather than waiting for its next `record_routing_stats` poll: as
        `routing_stats` (for the affinity router), and the GPU and loading ones as this
        replica's multiplexed model ids, which Serve's default router (`router: pow2`) prefers,
        as it would with `@serve.multiplexed` (whose replicas push theirs every 0.1 s)."""
        stats = await self._read_routing_stats()
        if stats is None:
            return
        residency = _Residency(sorted(stats.gpu), sorted(stats.loading), sorted(stats.host))
        if residency == self._published:
            return
        await asyncio.to_thread(
            ray_runtime.push_routing_info,
            self._serve.replica_id,
            residency.gpu + residency.loading,
            routing_stats_dict(stats),
        )
        self._published = residency

    async def _follow_hints(self) -> None:
        from router.hints import board_name, follow_hints, get_or_create_board

        name = board_name(self._serve.app_name, self._serve.deployment)
        await follow_hints(self.replica_id, lambda: get_or_create_board(name), self._take_hints)

    async def _take_hints(self, hints: list[tuple[str, float]]) -> None:
        self.engine.hint(hints)

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"engine loop stopped: {self.engine.last_error!r}")

    def __del__(self) -> None:
        tasks = [
            getattr(self, name, None) for name in ("_stats_task", "_lease_task", "_ledger_task")
        ]
        for task in [*tasks, *getattr(self, "_routing_tasks", [])]:
            if task is not None:
                task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _Residency(NamedTuple):
    """Where a replica's adapters are, each tier sorted."""

    gpu: list[str]
    loading: list[str]
    host: list[str]


async def _every(period_s: float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run `work` every `period_s` until cancelled or the engine stops (the health check reports
    a stopped engine; a replica shutting down stops its engine before these tasks see their
    cancellation); any other failure is logged and the loop goes on."""
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except EngineStopped:
            return
        except Exception:
            logger.exception("%s failed", what)
        await asyncio.sleep(period_s)
