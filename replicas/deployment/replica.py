"""The Ray Serve deployment that wraps one engine replica. The only Ray code in `replicas/`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

from ray import serve

from replicas.adapter_ledger import (
    ENTRIES_KEPT,
    AdapterEntry,
    LedgerFollower,
    LedgerStore,
    LoadMismatch,
    Superseded,
    newest,
)
from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.engine import Engine, RequestRejected
from replicas.leases import CallerLeases
from replicas.protocol import GenerateChunk, GenerateRequest

logger = logging.getLogger("ray.serve")

STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 0.5
RESIDENCY_PERIOD_S = 0.1  # how often a replica checks whether its adapter residency changed
WAIT_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LEDGER_SYNC_S = 5.0  # how often a replica catches up with the runtime adapter ledger
LEDGER_NAMESPACE = "lorafleet"
# How long a caller counts as alive before it is asked after again: a dead caller's requests
# are aborted within LEASE_S + LEASE_SWEEP_S of its death (plus the GCS's own notice, ~20 ms,
# and its answer). A live caller's requests are never aborted, however late the answer.
LEASE_S = 0.5
CHANNEL_IDLE_S = 1.0  # a caller's channel with nothing to send for this long ends (a draining
# replica waits for it: Serve counts it as an ongoing request)
LEASE_SWEEP_S = 0.25  # how often a replica looks for callers whose lease lapsed
CALLERS_KEPT = 64  # callers whose last request's end `stats()` reports
LOAD_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=10)
class EngineDeployment:
    """One engine replica. `prepare` runs first on the replica's node (it makes sure the model
    files exist there, e.g. building the embedded demo); `engine_cls` and `metrics` are
    injectable for tests. When built inside an event loop (as Serve does), a background task
    turns `stats()` into metrics every `stats_period_s`."""

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
        self.replica_id = _replica_id()
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.metrics.set_slot_capacity(config.max_loras_per_batch)
        self.leases = CallerLeases(clock)
        # Which callers (ingress replicas' actor ids) are known dead: asked only of callers whose
        # lease lapsed, so a live ingress sends nothing to keep its requests.
        self._dead_callers = (
            dead_callers if dead_callers is not None else _gcs_liveness(_serve_context())
        )
        self.num_abandoned = 0  # requests aborted because their caller's lease lapsed
        self.abandoned_at: float | None = None  # wall clock (time.time) of the last of them
        # caller -> wall clock when its last live request here ended (the newest CALLERS_KEPT)
        self.caller_done_at: dict[str, float] = {}
        self._serve = _serve_context()
        # Adapters loaded and unloaded at run time, kept by the fleet (replicas/adapter_ledger.py):
        # caught up with before the engine starts, then every LEDGER_SYNC_S.
        self.ledger = ledger if ledger is not None else _fleet_ledger(self._serve)
        self.follower = LedgerFollower()
        engine = engine_cls(config)
        if self.ledger is not None:
            self._follow(engine, self.ledger.read_all())
        self.engine = AsyncEngine(
            engine, config.stream_interval_s, config.max_stream_chunks_per_s
        )
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
        self._routing_stats: dict[str, Any] | None = None  # the last answer, for slow engines
        self._published: dict[str, list[str]] | None = None  # residency last pushed to Serve
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
        if caller is not None:
            self.leases.track(request.request_id, caller, lease_s)
        first = True
        try:
            async for chunk in self.engine.generate(request, caller):
                if chunk.metrics is not None:
                    self.metrics.request_finished(request.adapter is not None, chunk.metrics)
                if first:  # where the caller may open a channel (`channel`)
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
        if replica_id != self.replica_id:
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
                self.num_abandoned += 1
                self.abandoned_at = time.time()
                logger.warning("aborting request %s: its caller %s is dead", request_id, caller)
                self.engine.abort(request_id, "the request's caller went away")
            self.engine.drop_channel(caller)
            self._caller_done(caller)

    async def info(self) -> dict:
        engine = self.engine.engine
        return {
            "max_model_len": engine.max_model_len,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "vocab_size": engine.spec.vocab_size,
        }

    async def stats(self) -> dict:
        """The engine's `EngineStats`, plus `num_held_slots` (GPU slots held by requests),
        `num_aborted` (live requests aborted: the caller closed the stream, or went away) and
        `num_abandoned` (those whose caller's lease lapsed; `abandoned_at` the wall-clock time
        of the last), `step_cpu_s` (the engine thread's CPU time inside steps), `callers` (each
        caller's live requests here) and `caller_done_at` (when each recent caller's last request
        here ended, or was aborted as abandoned: wall clock)."""
        stats = await self.engine.call(_engine_stats)
        stats["num_aborted"] = self.engine.num_aborted
        stats["step_cpu_s"] = self.engine.step_cpu_s
        stats["callers"] = self.leases.callers()
        stats["caller_done_at"] = dict(self.caller_done_at)
        stats["num_abandoned"] = self.num_abandoned
        stats["abandoned_at"] = self.abandoned_at
        return stats

    async def replica_stats(self) -> dict:
        """`stats()` with this replica's id, for readings gathered from every replica."""
        return {"replica_id": self.replica_id, **await self.stats()}

    async def report_stats(self) -> None:
        """Read `stats()` once into the metrics."""
        self.metrics.update(await self.stats())

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
        await self.engine.call(self.follower.load, name, path, pinned, load_id, version)

    async def unload_adapter(
        self, name: str, load_id: str | None = None, version: int | None = None
    ) -> None:
        """New requests for `name` are refused (NOT_FOUND); queued and running ones finish. With
        `load_id`, only when that load is what registered `name` here. Raises RequestRejected
        NOT_FOUND otherwise, or when `name` is not loaded. An unload of a `version` this replica
        already applied from the ledger succeeds."""
        try:
            await self.engine.call(self.follower.unload, name, load_id, version)
        except (LoadMismatch, Superseded) as e:
            raise RequestRejected.of(e) from e

    async def sync_adapters(self) -> list[str]:
        """Catch up with the ledger (every `LEDGER_SYNC_S` under Serve): load and unload what
        changed since this replica last applied each name. Returns the names changed here."""
        if self.ledger is None:
            return []
        entries = await asyncio.to_thread(self.ledger.read_all)
        return await self.engine.call(self._follow, entries)

    def _follow(self, engine: Engine, entries: dict[str, AdapterEntry]) -> list[str]:
        """On the engine thread (or before it starts)."""
        failures = dict(self.follower.failures)
        changed = self.follower.follow(engine, entries)
        for name in changed:
            entry = entries[name]
            logger.info("adapter %s %s from the ledger", name, entry.path or "unloaded")
        for name, reason in self.follower.failures.items():
            if failures.get(name) != reason:
                logger.warning(
                    "could not apply the ledger's entry for adapter %s: %s", name, reason
                )
        return changed

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
        return await self.engine.call(_served_adapters)

    async def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        self.engine.hint([(adapter, eta_s)])

    # -- routing -------------------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router places requests by, polled by Serve's controller every
        `request_routing_stats_period_s`: `{"gpu", "loading", "host": [adapter], "num_slots",
        "free_slots", "num_waiting", "num_running"}`. The engine answers between steps; when it
        takes longer than `ROUTING_STATS_TIMEOUT_S`, the previous answer (or an empty one) is
        returned rather than holding the controller up."""
        try:
            stats = await asyncio.wait_for(
                self.engine.call(_routing_stats), ROUTING_STATS_TIMEOUT_S
            )
        except TimeoutError:
            return self._routing_stats or {}
        self._routing_stats = stats
        return stats

    async def publish_residency(self) -> None:
        """When the adapters on GPU, loading or in host memory changed, push them to Serve's
        controller at once rather than waiting for its next `record_routing_stats` poll: as
        `routing_stats` (for the affinity router), and the GPU and loading ones as this
        replica's multiplexed model ids, which Serve's default router (`router: pow2`) prefers,
        as it would with `@serve.multiplexed` (whose replicas push theirs every 0.1 s)."""
        stats = await self.record_routing_stats()
        if not stats:
            return
        residency = {tier: sorted(stats[tier]) for tier in ("gpu", "loading", "host")}
        if residency == self._published:
            return
        model_ids = residency["gpu"] + residency["loading"]
        await asyncio.to_thread(_push_routing_info, self._serve.replica_id, model_ids, stats)
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


class EngineMetrics:
    """The replica's metrics, exported through `ray.serve.metrics` (Serve adds the deployment,
    replica and application tags). `backend` is `ray.serve.metrics` or anything with its
    `Counter`, `Gauge` and `Histogram` constructors (tests pass a recording fake).

    `update(stats)` sets the gauges from a `stats()` snapshot and adds the counters' growth since
    the previous one; `request_finished` observes a finished request's waits. No adapter-name
    tags: names are unbounded.
    """

    def __init__(self, backend: Any = None) -> None:
        m = backend if backend is not None else _serve_metrics()
        self.running = m.Gauge(
            "lorafleet_engine_running_requests", description="Requests running in the engine."
        )
        self.waiting = m.Gauge(
            "lorafleet_engine_waiting_requests",
            description="Requests queued in the engine, waiting to be admitted.",
        )
        self.slots_used = m.Gauge(
            "lorafleet_adapter_slots_used",
            description="GPU adapter slots holding an adapter (loaded or loading).",
        )
        self.slots_total = m.Gauge(
            "lorafleet_adapter_slots", description="GPU adapter slots (max_loras_per_batch)."
        )
        self.kv_blocks_free = m.Gauge(
            "lorafleet_kv_blocks_free", description="Free KV cache blocks."
        )
        self.kv_blocks_total = m.Gauge("lorafleet_kv_blocks", description="KV cache blocks.")
        self.steps = m.Counter("lorafleet_engine_steps", description="Engine steps run.")
        self.loads = m.Counter(
            "lorafleet_adapter_loads",
            description=(
                "Adapter loads by the tier loaded into: host (read from disk) or gpu (copied "
                "into a GPU slot)."
            ),
            tag_keys=("tier",),
        )
        self.prefetch_loads = m.Counter(
            "lorafleet_adapter_prefetch_loads",
            description="GPU slot loads the prefetcher started ahead of a request's admission.",
        )
        self.slot_hits = m.Counter(
            "lorafleet_adapter_slot_hits",
            description="Admissions that found their adapter already in a GPU slot.",
        )
        self.slot_misses = m.Counter(
            "lorafleet_adapter_slot_misses",
            description="Admissions that had to bring their adapter into a GPU slot.",
        )
        self.load_latency = m.Histogram(
            "lorafleet_adapter_load_seconds",
            description="Time to read an adapter from disk into host memory.",
            boundaries=LOAD_BUCKETS_S,
        )
        self.adapter_wait = m.Histogram(
            "lorafleet_adapter_wait_seconds",
            description="Time an adapter request waited for its adapter to reach a GPU slot.",
            boundaries=WAIT_BUCKETS_S,
        )
        self.queue_time = m.Histogram(
            "lorafleet_queue_seconds",
            description="Time a request waited in the engine's queue before admission.",
            boundaries=WAIT_BUCKETS_S,
            tag_keys=("model_kind",),
        )
        # stats() key -> the counter that follows it, and its tags
        self._counted = {
            "num_steps": (self.steps, None),
            "adapter_disk_reads": (self.loads, {"tier": "host"}),
            "adapter_gpu_loads": (self.loads, {"tier": "gpu"}),
            "adapter_prefetch_loads": (self.prefetch_loads, None),
            "adapter_hits": (self.slot_hits, None),
            "adapter_misses": (self.slot_misses, None),
        }
        self._seen: dict[str, int] = {}

    def set_slot_capacity(self, num_slots: int) -> None:
        self.slots_total.set(num_slots)

    def update(self, stats: dict[str, Any]) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.slots_used.set(len(stats["resident_adapters"]))
        self.kv_blocks_free.set(stats["num_free_kv_blocks"])
        self.kv_blocks_total.set(stats["num_kv_blocks"])
        growth = {key: self._growth(key, stats) for key in self._counted}
        for key, (counter, tags) in self._counted.items():
            if growth[key] > 0:
                counter.inc(growth[key], tags=tags)
        reads = growth["adapter_disk_reads"]
        # `adapter_read_seconds` is a window of the latest disk-read latencies, one per read
        # (reads in blocking mode are counted but not timed, so they add none).
        window = stats.get("adapter_read_seconds", [])
        for seconds in window[len(window) - min(reads, len(window)) :]:
            self.load_latency.observe(seconds)

    def _growth(self, key: str, stats: dict[str, Any]) -> int:
        value = int(stats[key])
        grown = value - self._seen.get(key, 0)
        self._seen[key] = value
        return grown if grown >= 0 else value  # a counter that went back was reset

    def request_finished(self, adapter: bool, metrics: dict[str, float]) -> None:
        kind = "adapter" if adapter else "base"
        self.queue_time.observe(metrics.get("queue_s", 0.0), tags={"model_kind": kind})
        if adapter:
            self.adapter_wait.observe(metrics.get("adapter_wait_s", 0.0))


class RayLedger:
    """The adapter ledger (`LedgerStore`) in Ray's GCS key-value store, which outlives every
    replica: one key per entry, `adapters::<app>::<deployment>::<name>@<version>`, never
    overwritten (the GCS store has no compare-and-set; distinct keys need none). Calls block."""

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self.prefix = f"adapters::{app_name}::{deployment_name}::"

    def _key(self, name: str, version: int) -> str:
        return f"{self.prefix}{name}@{version:020d}"

    def read_all(self) -> dict[str, AdapterEntry]:
        from ray.experimental import internal_kv

        entries: list[AdapterEntry] = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=LEDGER_NAMESPACE):
            value = internal_kv._internal_kv_get(key, namespace=LEDGER_NAMESPACE)
            if value is None:  # deleted since listed
                continue
            try:
                entries.append(AdapterEntry.from_json(value))
            except (ValueError, TypeError) as e:
                logger.warning("skipping an unreadable ledger entry %r: %s", key, e)
        return newest(entries)

    def write(self, entry: AdapterEntry) -> None:
        from ray.experimental import internal_kv

        key = self._key(entry.name, entry.version)
        value = entry.to_json()
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=LEDGER_NAMESPACE)
        # Keep the name's newest few. Its own keys: a longer name listed under the same prefix
        # ("x@y" under "x@") leaves a tail that is not all digits.
        own = f"{self.prefix}{entry.name}@"
        keys = []
        for raw in internal_kv._internal_kv_list(own, namespace=LEDGER_NAMESPACE):
            listed = raw.decode() if isinstance(raw, bytes) else raw
            tail = listed[len(own) :]
            if tail.isdigit():
                keys.append((int(tail), listed))
        for _, stale in sorted(keys)[:-ENTRIES_KEPT]:
            internal_kv._internal_kv_del(stale, namespace=LEDGER_NAMESPACE)

    def retract(self, entry: AdapterEntry) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(
            self._key(entry.name, entry.version), namespace=LEDGER_NAMESPACE
        )


def _fleet_ledger(serve_context: Any) -> RayLedger | None:
    """The ledger of this replica's deployment under Serve; None outside Serve."""
    if serve_context is None:
        return None
    return RayLedger(serve_context.app_name, serve_context.deployment)


def _serve_metrics() -> Any:
    from ray.serve import metrics

    return metrics


def _replica_id() -> str:
    """This replica's id as Serve's metrics and logs name it; "local" outside Serve."""
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


def _gcs_liveness(serve_context: Any) -> GcsLiveness | None:
    """Under Serve, the callers Ray's GCS reports dead; None outside Serve."""
    return GcsLiveness() if serve_context is not None else None


class GcsLiveness:
    """`await liveness(actor_ids)`: those of `actor_ids` that Ray's GCS reports DEAD.

    One read at a time, on a worker thread (the GCS accessor is shared), bounded by `timeout_s`.
    Only a DEAD state counts: an actor the table does not show, a read that fails or times out,
    or a sweep that comes while an earlier read still runs, reports none dead. A slow or
    unavailable GCS delays the abort of a dead caller's requests; it never aborts a live one's.
    """

    def __init__(self, timeout_s: float = 2.0, read: Callable[[str], Any] | None = None) -> None:
        self.timeout_s = timeout_s
        self._read = read if read is not None else _actor_state
        self._reading: asyncio.Future | None = None

    async def __call__(self, actor_ids: list[str]) -> set[str]:
        if self._reading is not None and not self._reading.done():
            return set()  # the GCS has not answered the last sweep yet
        self._reading = asyncio.ensure_future(asyncio.to_thread(self._dead, list(actor_ids)))
        try:
            return await asyncio.wait_for(asyncio.shield(self._reading), self.timeout_s)
        except TimeoutError:
            logger.warning(
                "the GCS did not say within %g s whether callers are alive", self.timeout_s
            )
            return set()

    def _dead(self, actor_ids: list[str]) -> set[str]:
        dead = set()
        for actor_id in actor_ids:
            try:
                state = self._read(actor_id)
            except Exception as e:  # unsure: keep the requests, ask again later
                logger.warning("could not read the state of caller %s: %r", actor_id, e)
                continue
            if state == "DEAD":
                dead.add(actor_id)
        return dead


def _actor_state(actor_id: str) -> str | None:
    """The actor's state in Ray's GCS ("ALIVE", "DEAD", ...), None when the table has no entry."""
    from ray._private import state

    info = state.actors(actor_id=actor_id)
    return info.get("State") if info else None


def _serve_context() -> Any:
    """Serve's replica context (`replica_id`, `app_name`, `deployment`), or None outside Serve."""
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context()
    except RayServeException:
        return None


def _push_routing_info(replica_id: Any, model_ids: list[str], stats: dict[str, Any]) -> None:
    """Send Serve's controller this replica's multiplexed model ids and routing stats, the
    message `@serve.multiplexed` sends for its model ids (Serve has no public call for it; the
    controller passes both on to every router). Fire-and-forget, but fetching the controller
    client may block the first time."""
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # without a controller it raises instead
    client.record_request_routing_info(
        RequestRoutingInfo(
            replica_id=replica_id, multiplexed_model_ids=model_ids, routing_stats=stats
        )
    )


def _routing_stats(engine: Engine) -> dict[str, Any]:
    stats = engine.routing_stats()
    return {
        "gpu": list(stats.gpu),
        "loading": list(stats.loading),
        "host": list(stats.host),
        "num_slots": stats.num_slots,
        "free_slots": stats.free_slots,
        "num_waiting": stats.num_waiting,
        "num_running": stats.num_running,
    }


async def _every(period_s: float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run `work` every `period_s` until cancelled; a failure is logged and the loop goes on."""
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed", what)
        await asyncio.sleep(period_s)


def _engine_stats(engine: Engine) -> dict:
    stats = asdict(engine.stats())
    stats["adapter_read_seconds"] = list(stats["adapter_read_seconds"])
    stats["num_held_slots"] = engine.adapters.slots.num_held  # slots a request holds
    return stats


def _served_adapters(engine: Engine) -> dict[str, Any]:
    served = engine.served_adapters()
    return {"adapters": dict(served.adapters), "unloaded": list(served.unloaded)}
