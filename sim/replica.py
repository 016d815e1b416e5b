"""One engine replica on the virtual clock, built from the engine's own plain-Python parts.

Real parts, unchanged: `Scheduler` (replicas/scheduler.py) with its `BlockAllocator`, `SlotPool`
(which adapter in which slot, eviction), `HostCache` (pinned host LRU, here holding `FakeWeights`),
`PrefetchQueue` (what to load next and what to give up for it), `CopyBudget` (when a copy in
flight may join a step, learnt from the steps run) and `ReadTurns` (disk reads take turns),
`Request` and `RoutingStats`.

Simulated: the device and the disk. A step takes `Calibration.step_s` of what it computes; a
disk read takes `read_s`, or `reuse_read_s` when an adapter the host cache evicted left pinned
buffers for it to reuse (PyTorch's caching host allocator); host->GPU copies run one after
another on the load stream, `copy_s` each, and a step whose adapters' copies have not landed
ends no earlier than they land (its layers wait on them). `SimAdapters` is
`replicas/adapters/manager.py: AdapterManager` with the reader and uploader replaced by those
timings: the same gate (`is_resident`, `prepare`, `copy_settled`, `acquire`, `release`), the
same `tick` (queue the waiting requests' adapters, start reads for the soonest needs, start the
loads the budget allows) and the same residency report. `SimReplica` is `replicas/engine.py:
Engine.step` (before_step -> schedule -> run -> postprocess) with `poll_during_step`'s rule: a
request, hint or finished read that arrives while a step runs plans loads at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from replicas.adapters.host_cache import HostCache
from replicas.adapters.policy import READ_WORKERS, CopyBudget, ReadTurns
from replicas.adapters.prefetcher import HINT_TTL_S, PrefetchQueue, prefetch_round  # noqa: F401
from replicas.adapters.slot_pool import SlotPool
from replicas.engine_stats import RoutingStats
from replicas.kv_cache import BlockAllocator
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduler import Scheduler, SchedulerConfig
from sim.calibration import Calibration
from sim.events import EventLoop


@dataclass(frozen=True)
class FakeWeights:
    """What the host cache holds for an adapter in the simulator: its size."""

    nbytes: int
    rank: int = 16


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine settings the simulator honours (replicas/config.py `EngineConfig` names)."""

    max_loras_per_batch: int = 8
    max_loaded_loras: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 65536
    kv_reserve_ratio: float = 0.5
    eviction_policy: str = "lru"
    read_workers: int = READ_WORKERS
    prefetch: bool = True  # adapter_loading "prefetch" (else "overlap": no loads ahead of need)


@dataclass
class _Copy:
    start: float
    land: float


class SimAdapters:
    """`AdapterManager` on the virtual clock: the scheduler's `AdapterGate` and the engine's
    per-step adapter work. `on_ready()` is called when a disk read finishes or a copy lands."""

    def __init__(
        self,
        loop: EventLoop,
        cal: Calibration,
        config: ReplicaConfig,
        on_ready: Callable[[], None] = lambda: None,
    ) -> None:
        self.loop = loop
        self.cal = cal
        self.prefetch = config.prefetch
        self.on_ready = on_ready
        self.slots = SlotPool(config.max_loras_per_batch, config.eviction_policy)
        self.host: HostCache[FakeWeights] = HostCache(config.max_loaded_loras)
        self.queue = PrefetchQueue(capacity=max(64, 4 * config.max_loaded_loras))
        self.turns = ReadTurns(config.read_workers, clock=loop.now)
        self.budget = CopyBudget(copy_bytes_per_s=cal.copy_bytes_per_s)
        self._reads: dict[str, float] = {}  # started, not collected: adapter -> when it is done
        self._copies: dict[int, _Copy] = {}  # slot -> its latest copy
        self._stream_free = 0.0  # when the load stream has landed everything queued on it
        self._spare_buffers = 0  # pinned buffer sets of evicted adapters, free for a read
        self.disk_reads = 0
        self.gpu_loads = 0
        self.prefetch_loads = 0
        self.hits = 0
        self.misses = 0

    # -- the scheduler's gate (AdapterManager's, rule for rule) --------------------------------

    def attach(self, adapter: str) -> None:
        """Nothing to count: the fleet on the virtual clock never unloads an adapter."""

    def detach(self, adapter: str) -> None:
        """As `attach`."""

    def is_resident(self, adapter: str) -> bool:
        return adapter in self.slots

    def prepare(self, adapter: str) -> bool:
        if adapter in self.slots or adapter in self.host:
            return True
        self._start_read(adapter)
        return self._collect(adapter)

    def copy_settled(self, adapter: str, prefill_tokens: int = 0) -> bool:
        copy = self._pending(self.slots.slot_of(adapter))
        if copy is None:
            return True
        if self.budget.admits(self._bytes_to_land(copy.land), prefill_tokens):
            return True
        return self.loop.now() >= (copy.start + copy.land) / 2  # Copy.half_landed

    def acquire(self, adapter: str) -> int | None:
        if adapter in self.slots:
            self.hits += 1
            self.queue.discard(adapter)
            return self.slots.hold(adapter)
        if not self.slots.can_assign():
            return None
        if self.host.get(adapter) is None:
            return None
        self.misses += 1
        self._load(adapter)
        self.queue.discard(adapter)
        return self.slots.hold(adapter)

    def release(self, adapter: str) -> None:
        self.slots.release(adapter)

    # -- prefetch -------------------------------------------------------------------------------

    def hint(self, adapter: str, due: float) -> None:
        if self.prefetch:
            self.queue.hint(adapter, due)

    def tick(self, waiting: list[tuple[str, float]]) -> None:
        """`AdapterManager.tick`: collect finished reads, queue the waiting requests' adapters,
        start reads for the soonest needs, start the loads the copy budget allows."""
        for adapter in list(self._reads):
            self._collect(adapter)
        if not self.prefetch:
            return
        self.prefetch_loads += prefetch_round(
            self.queue, self.slots, self.host, self.budget, waiting, self.loop.now(),
            known=lambda a: a in self.slots or a in self.host,
            start_read=self._start_read,
            queued_bytes=lambda: self._bytes_to_land(self._stream_free),
            load=lambda adapter, _entry: self._load(adapter),
        )  # fmt: skip

    def reads_finished(self) -> bool:
        """A read is done and not collected (`AdapterReader.finished`)."""
        now = self.loop.now()
        return any(done <= now for done in self._reads.values())

    # -- the step --------------------------------------------------------------------------------

    def landing(self, slots: set[int]) -> float:
        """When the copies into `slots` have all landed (now or earlier: none in flight)."""
        lands = [c.land for s in slots if (c := self._pending(s)) is not None]
        return max(lands, default=self.loop.now())

    def residency(self) -> dict[str, list[str]]:
        """`AdapterManager.residency`: "gpu" (copy landed), "loading" (a copy or a disk read
        in flight, or read and not collected), "host"."""
        tiers: dict[str, list[str]] = {"gpu": [], "loading": [], "host": []}
        for name in sorted(set(self.slots.resident) | set(self.host) | set(self._reads)):
            slot = self.slots.slot_of(name)
            if slot is not None:
                tiers["gpu" if self._pending(slot) is None else "loading"].append(name)
            elif name in self._reads:
                tiers["loading"].append(name)
            else:
                tiers["host"].append(name)
        return tiers

    # -- internals ------------------------------------------------------------------------------

    def _pending(self, slot: int | None) -> _Copy | None:
        copy = None if slot is None else self._copies.get(slot)
        return copy if copy is not None and copy.land > self.loop.now() else None

    def _bytes_to_land(self, land: float) -> float:
        # The load stream runs copies one after another: what lands by `land` is all queued
        # ahead of it, at the copy bandwidth.
        return max(0.0, land - self.loop.now()) * self.cal.copy_bytes_per_s

    def _load(self, adapter: str) -> None:
        slot = self.slots.assign(adapter).slot
        now = self.loop.now()
        start = max(now, self._stream_free)
        land = self._stream_free = start + self.cal.copy_s
        self._copies[slot] = _Copy(start, land)
        self.gpu_loads += 1
        self.loop.at(land, self.on_ready)

    def _start_read(self, adapter: str) -> bool:
        if adapter in self._reads:
            return True
        now = self.loop.now()
        if not self.turns.free(a for a, done in self._reads.items() if done > now):
            return False
        self.turns.start(adapter)
        reuse = self._spare_buffers > 0
        self._spare_buffers -= reuse
        done = self._reads[adapter] = now + (self.cal.reuse_read_s if reuse else self.cal.read_s)
        self.loop.at(done, self.on_ready)
        return True

    def _collect(self, adapter: str) -> bool:
        done = self._reads.get(adapter)
        if done is None or done > self.loop.now():
            return False
        del self._reads[adapter]
        self.turns.finish(adapter)
        evicted = self.host.put(adapter, FakeWeights(self.cal.adapter_bytes))
        self._spare_buffers += len(evicted)
        self.disk_reads += 1
        return True


class SimReplica:
    """One engine on the virtual clock. `submit(request)` queues a `Request`; the replica calls
    `on_token(request, first)` for every token and `on_done(request)` when it finishes (also on
    `kill`, with status FINISHED_ABORTED)."""

    def __init__(
        self,
        replica_id: str,
        loop: EventLoop,
        cal: Calibration,
        config: ReplicaConfig,
        on_token: Callable[[Request, bool], None],
        on_done: Callable[[Request], None],
    ) -> None:
        self.replica_id = replica_id
        self.loop = loop
        self.cal = cal
        self.config = config
        self.on_token = on_token
        self.on_done = on_done
        self.adapters = SimAdapters(loop, cal, config, on_ready=self._on_ready)
        self.blocks = BlockAllocator(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_model_len,
                kv_reserve_ratio=config.kv_reserve_ratio,
                min_kv_reserve_ratio=0.1 * config.kv_reserve_ratio,  # as Engine builds it
            ),
            self.blocks,
            self.adapters,
            clock=loop.now,
        )
        self.alive = True
        self.busy = False
        self.num_steps = 0
        self.busy_s = 0.0

    # -- the engine's interface ------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """`Engine.add_request`: queue it; a running step plans its adapter's load at once."""
        if not self.alive:
            raise RuntimeError(f"{self.replica_id} is dead")
        if request.adapter is not None:
            request.cold_adapter = not self.adapters.is_resident(request.adapter)
        self.scheduler.add(request)
        self._poll()

    def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        """`Engine.prefetch_hint`."""
        if self.alive:
            self.adapters.hint(adapter, self.loop.now() + eta_s)
            self._poll()

    def routing_stats(self) -> RoutingStats:
        """`Engine.routing_stats`."""
        tiers = self.adapters.residency()
        return RoutingStats(
            gpu=tuple(tiers["gpu"]),
            loading=tuple(tiers["loading"]),
            host=tuple(tiers["host"]),
            num_slots=self.adapters.slots.num_slots,
            free_slots=self.adapters.slots.num_free,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
        )

    def kill(self) -> list[Request]:
        """The replica dies: every request on it ends aborted; returns them."""
        self.alive = False
        lost = list(self.scheduler.requests())
        for request in lost:
            self.scheduler.abort(request.request_id)
            self.on_done(request)
        return lost

    # -- the step loop ---------------------------------------------------------------------------

    def _poll(self) -> None:
        if not self.alive:
            return
        if self.busy:
            # Engine.poll_during_step: new needs start their loads while the step runs.
            self.adapters.tick(self._waiting_needs())
        else:
            self._step()

    def _on_ready(self) -> None:
        if self.alive and (self.busy and self.adapters.reads_finished() or not self.busy):
            self._poll()

    def _step(self) -> None:
        """`Engine.step`: before_step -> schedule -> run (here: the clock advances)."""
        if not self.scheduler.has_work:
            return
        self.adapters.tick(self._waiting_needs())
        sched = self.scheduler.schedule()
        for request in sched.failed:
            self.on_done(request)
        if sched.empty:
            return  # stalled on reads: `_on_ready` steps again
        self.num_steps += 1
        seqs = sched.seqs
        adapters = {s.request.adapter for s in seqs if s.request.adapter is not None}
        prefill = sum(s.num_new_tokens for s in seqs if s.num_new_tokens > 1)
        now = self.loop.now()
        compute = self.cal.step_s(len(seqs), len(adapters), prefill)
        slots = {s.request.slot for s in seqs if s.request.slot is not None}
        land = self.adapters.landing(slots)
        # The step's layers wait on their adapters' copies (an event per layer): it ends once
        # the last copy has landed and the last layer has run after it.
        end = max(now + compute, land + compute / 32)
        self.busy = True
        self.loop.at(end, self._step_done, seqs, end - now, prefill, land > now)

    def _step_done(self, seqs, elapsed: float, prefill: int, gated: bool) -> None:
        """`Engine._postprocess` and the copy budget's `observe_step`."""
        self.busy = False
        if not self.alive:
            return
        self.busy_s += elapsed
        self.adapters.budget.observe_step(elapsed, prefill, gated)
        sampled = [s for s in seqs if s.samples]
        for s in seqs:
            s.request.num_computed_tokens += s.num_new_tokens
        for s in sampled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted meanwhile (cannot happen within one step; kept safe)
            request.output_token_ids.append(0)
            self.on_token(request, len(request.output_token_ids) == 1)
            if len(request.output_token_ids) >= request.sampling.max_tokens:
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                self.on_done(request)
        self._step()

    def _waiting_needs(self) -> list[tuple[str, float]]:
        return [(r.adapter, r.arrival_time) for r in self.scheduler.waiting if r.adapter]


def make_request(
    request_id: str, adapter: str | None, prompt_tokens: int, output_tokens: int, now: float
) -> Request:
    """An engine `Request` for the simulator: `prompt_tokens` placeholder ids, exactly
    `output_tokens` out."""
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * prompt_tokens,
        sampling=SamplingParams(max_tokens=output_tokens, ignore_eos=True),
        adapter=adapter,
        arrival_time=now,
    )


def capacity_rps(cal: Calibration, config: ReplicaConfig, prompt: float, output: float) -> float:
    """Requests per second one replica finishes with a full batch of `max_num_seqs` sequences
    over as many adapters as it has slots, averaging `prompt` and `output` tokens: each
    sequence holds its seat for `output` steps, and each step also prefills the prompts of the
    requests replacing the ones that finished."""
    seqs = config.max_num_seqs
    adapters = min(seqs, config.max_loras_per_batch)
    step = cal.step_s(seqs, adapters, round(seqs * prompt / output))
    return seqs / (output * step)
