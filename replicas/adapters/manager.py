"""The engine's adapter manager: name -> path -> host weights -> GPU slot.

Implements the scheduler's `AdapterGate`. Names resolve to adapters registered at start-up (or
later through `register`), then to `adapter_root/<name>`.

Tiers: disk (PEFT safetensors, validated once when read) -> host LRU (`HostCache`, pinned memory
on CUDA) -> GPU slot (`SlotPool` policy + `LoraWeightPool` buffers). Three loading modes:

- "blocking": a request's adapter is read and copied while the step waits (the simple baseline).
- "overlap": disk reads run on a worker pool and host->GPU copies on a dedicated load stream,
  while requests whose adapters are ready keep running; nothing is loaded before it is needed.
- "prefetch": as "overlap", plus a prefetch queue fed by the waiting queue and by hints from
  outside the engine (`hint`), loading soonest-needed adapters into free or reclaimable slots
  ahead of admission.

Only the engine thread calls into this object; worker threads only read files.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from replicas.adapters.host_cache import HostCache
from replicas.adapters.loader import (
    AdapterError,
    AdapterWeights,
    read_adapter_config,
    read_adapter_file,
)
from replicas.adapters.prefetcher import PrefetchQueue, SlotView
from replicas.adapters.slot_pool import SlotPool
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from replicas.scheduler import AdapterLoadError

logger = logging.getLogger(__name__)

LOADING_MODES = ("blocking", "overlap", "prefetch")
# A copy expected to land within COPY_STEPS recent steps (or SHORT_COPY_S, if longer) never holds
# a request back (`copy_settled`): it arrives layer by layer while the step computes, and
# stretches the step it joins by at most one step's time -- what admitting the request a step
# later would cost that request anyway. "Land" counts what is still to land of it and of the
# copies queued ahead of it (the load stream runs its copies one after another, each layer by
# layer; a copy started during the last step is partly there). The same window bounds what the
# prefetcher queues on the load stream, so a need that shows up later waits behind at most that.
# A request's own prefill widens the window by the time its tokens add to the step: the layers of
# a long prompt take about as long as a large copy, so the copy lands under them.
SHORT_COPY_S = 0.005
COPY_STEPS = 2.0
STEP_COST_EMA = 0.2  # weight of the newest step in the step-cost averages
# A step's prefill tokens teach the per-token cost only from this many on: below it the step's
# fixed costs swamp them.
PREFILL_COST_MIN_TOKENS = 64
COPY_BYTES_PER_S = 50e9  # pinned host -> GPU over PCIe 5 (about 55 GB/s measured on an H100)
HINT_TTL_S = 30.0  # a hint whose request has not shown up this long after it was due is dropped
# Disk reads running at once. One read already spreads its file ranges and layers over the host
# threads (adapters/host_threads.py), and reads at once share the host's memory bandwidth (on an
# H100 host four rank-16 reads took 117 ms each, one alone 32 ms: benchmarks/bench_adapter_read),
# so more readers only delay the soonest need. Reads wait their turn in the prefetch queue's order.
READ_WORKERS = 1
# A read running longer than this no longer holds its turn, so a file on a hung file system
# does not stop every other adapter's read; the pool keeps threads for such reads.
READ_STALL_S = 5.0
READ_THREADS = 4


@dataclass
class Copy:
    """One adapter's host->GPU copy on the load stream: an event per layer, in layer order."""

    events: list  # torch.cuda.Event, recorded on the load stream after each layer's copy
    nbytes: int

    def landed(self) -> bool:
        return self.events[-1].query()

    def remaining_bytes(self) -> int:
        """Bytes of the layers not yet seen to land. The load stream lands a copy's layers in
        order, so the first pending event splits them: found in log2(layers) event queries."""
        lo, hi = 0, len(self.events)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.events[mid].query():
                lo = mid + 1
            else:
                hi = mid
        return self.nbytes * (len(self.events) - lo) // len(self.events)


@dataclass
class AdapterStats:
    disk_reads: int = 0  # disk -> host
    gpu_loads: int = 0  # host -> GPU slot
    prefetch_loads: int = 0  # GPU loads started by the prefetcher, ahead of admission
    hits: int = 0  # admissions that found the adapter already in a slot
    misses: int = 0  # admissions that had to bring it in
    read_seconds: list[float] = field(default_factory=list)  # recent disk read latencies


class AdapterManager:
    def __init__(
        self, spec: ModelSpec, weights: LoraWeightPool, max_lora_rank: int,
        adapters: dict[str, str], adapter_root: str | None, max_loaded_loras: int,
        dtype: torch.dtype, mode: str = "prefetch", pinned: tuple[str, ...] = (),
        read_workers: int = READ_WORKERS, eviction_policy: str = "lru",
        max_loaded_bytes: int | None = None,
    ) -> None:
        if mode not in LOADING_MODES:
            raise ValueError(f"adapter loading mode must be one of {LOADING_MODES}, got {mode!r}")
        self.spec = spec
        self.weights = weights
        self.max_lora_rank = max_lora_rank
        self.adapter_root = Path(adapter_root) if adapter_root else None
        self.dtype = dtype
        self.mode = mode
        self.paths: dict[str, Path] = {name: Path(p) for name, p in adapters.items()}
        self.pinned = set(pinned)
        self.retired: dict[str, Path] = {}  # unloaded, still used by queued or running requests
        self.unloaded: set[str] = set()  # names new requests may not use
        self.slots = SlotPool(weights.num_slots, eviction_policy)
        self.host: HostCache[AdapterWeights] = HostCache(
            max_loaded_loras, max_loaded_bytes, size=lambda w: w.nbytes
        )
        self.queue = PrefetchQueue(capacity=max(64, 4 * max_loaded_loras))
        self.stats = AdapterStats()
        self.on_cuda = weights.device.type == "cuda"
        self._stream = torch.cuda.Stream(weights.device) if self.on_cuda else None
        self.read_workers = read_workers
        self._pool = ThreadPoolExecutor(max(read_workers, READ_THREADS),
                                        thread_name_prefix="lora-read")
        self._reads: dict[str, Future[AdapterWeights]] = {}
        self._read_started: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        # slot -> the copy into it that no step has waited on yet
        self._pending: dict[int, Copy] = {}
        # every copy on the load stream not yet seen to land, in stream order
        self._in_flight: deque[Copy] = deque()
        # slot -> an event after the last step that read it (`mark_used`): a copy into the slot
        # waits for that step only, so it may start while a later step runs
        self._last_use: dict[int, torch.cuda.Event] = {}
        self.step_time_s = 0.0  # recent model step time (`observe_step`)
        self.decode_step_s = 0.0  # recent time of a step with no prefill that waited on no copy
        self.prefill_token_s = 0.0  # recent time one prefill token adds to a step

    # -- resolution ---------------------------------------------------------------------------

    def resolve(self, name: str) -> Path:
        """The folder of an adapter new requests may use, checked cheaply (config and files).
        Raises AdapterError: 404 for an unknown or unloaded name, 400 for unusable files."""
        path = self.paths.get(name)
        if path is None and name not in self.unloaded and self._under_root(name):
            path = self.adapter_root / name
        if path is None:
            raise AdapterError(f"the model {name!r} does not exist", status=404)
        read_adapter_config(path, self.max_lora_rank)
        return path

    def register(self, name: str, path: str | Path, *, pinned: bool = False) -> None:
        """Serve the adapter at `path` as `name` from now on. Raises AdapterError."""
        if name in self.paths or name in self.retired:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        read_adapter_config(path, self.max_lora_rank)
        self.paths[name] = Path(path)
        self.unloaded.discard(name)
        if pinned:
            self.pinned.add(name)

    def unregister(self, name: str) -> None:
        """New requests for `name` get 404 from now on; requests already queued or running
        finish with it. `forget` drops its weights once no request refers to it."""
        if name in self.paths:
            self.retired[name] = self.paths.pop(name)
        elif name not in self.unloaded and self._under_root(name):
            self.retired[name] = self.adapter_root / name
        else:
            raise AdapterError(f"adapter {name!r} is not loaded", status=404)
        self.unloaded.add(name)
        self.pinned.discard(name)
        self.queue.discard(name)
        if name in self.slots:
            self.slots.set_pinned(name, False)

    def forget(self, name: str) -> None:
        """Drop a retired adapter's weights (no request refers to it any more)."""
        self.retired.pop(name, None)
        self.host.remove(name)
        self._failed.pop(name, None)
        # A disk read still running is dropped, not collected: a later load of the same name may
        # point at another folder.
        self._reads.pop(name, None)
        self._read_started.pop(name, None)
        if name in self.slots and self.slots.holds(name) == 0:
            self.slots.remove(name)

    def _path(self, name: str) -> Path:
        """Where a queued request's adapter lives, retired ones included."""
        if name in self.retired:
            return self.retired[name]
        return self.resolve(name)

    def _under_root(self, name: str) -> bool:
        return (
            self.adapter_root is not None
            and _plain_name(name)
            and (self.adapter_root / name).is_dir()
        )

    # -- the scheduler's gate -------------------------------------------------------------------

    def is_resident(self, adapter: str) -> bool:
        return adapter in self.slots

    def prepare(self, adapter: str) -> bool:
        """True when the adapter can be placed in a slot now (on the GPU already, or its weights
        in host memory). Otherwise starts reading it and returns False. Raises AdapterLoadError
        when the files turned out unusable."""
        if adapter in self.slots or adapter in self.host:
            return True
        if adapter in self._failed:
            raise AdapterLoadError(self._failed.pop(adapter))
        if self.mode == "blocking":
            try:
                path = self._path(adapter)
            except AdapterError as e:
                raise AdapterLoadError(str(e)) from e
            started = time.monotonic()
            self._finish_read(adapter, self._read(adapter, path))
            self._record_read(time.monotonic() - started)
            return True
        self._start_read(adapter)
        if self._collect(adapter):
            return True
        if adapter in self._failed:
            raise AdapterLoadError(self._failed.pop(adapter))
        return False

    def copy_settled(self, adapter: str, prefill_tokens: int = 0) -> bool:
        """No copy of the adapter in flight, or one whose bytes still to land (its own and the
        copies' queued ahead of it) fit the copy window widened by `prefill_tokens` of the
        request's prefill, or one whose middle layer has landed. Queries events; never waits."""
        slot = self.slots.slot_of(adapter)
        copy = self._pending.get(slot) if slot is not None else None
        if copy is None:
            return True
        prefill_bytes = prefill_tokens * self.prefill_token_s * COPY_BYTES_PER_S
        if self._queued_bytes(through=copy) <= self.copy_window_bytes + prefill_bytes:
            return True
        return copy.events[len(copy.events) // 2].query()

    @property
    def copy_window_bytes(self) -> float:
        """What the load stream moves in COPY_STEPS recent steps (at least SHORT_COPY_S)."""
        return max(SHORT_COPY_S, COPY_STEPS * self.step_time_s) * COPY_BYTES_PER_S

    def observe_step(self, elapsed_s: float, prefill_tokens: int, gated: bool) -> None:
        """Learn from one model step: its time, and unless it waited on a copy, what a decode
        step costs and what a prefill token adds to one (the step's time beyond a decode step's,
        per prefill token)."""
        self.step_time_s += STEP_COST_EMA * (elapsed_s - self.step_time_s)
        if gated:
            return
        if prefill_tokens == 0:
            self.decode_step_s += STEP_COST_EMA * (elapsed_s - self.decode_step_s)
        elif prefill_tokens >= PREFILL_COST_MIN_TOKENS and self.decode_step_s > 0:
            per_token = max(0.0, elapsed_s - self.decode_step_s) / prefill_tokens
            self.prefill_token_s += STEP_COST_EMA * (per_token - self.prefill_token_s)

    def _queued_bytes(self, through: Copy | None = None) -> int:
        """Bytes still to land on the load stream up to and including `through` (all of them if
        None; 0 if it has landed): the layers of each copy not yet seen to land. Forgets landed
        copies."""
        while self._in_flight and self._in_flight[0].landed():
            self._in_flight.popleft()
        total = 0
        for copy in self._in_flight:
            total += copy.remaining_bytes()
            if copy is through:
                return total
        return 0 if through is not None else total

    def acquire(self, adapter: str) -> int | None:
        if adapter in self.slots:
            self.stats.hits += 1
            self.queue.discard(adapter)  # this need is served
            return self.slots.hold(adapter)
        if not self.slots.can_assign():
            return None
        weights = self.host.get(adapter)
        if weights is None:  # `prepare` was not called or its read is still running
            return None
        self.stats.misses += 1
        self._upload(adapter, weights, self.slots.assign(adapter, pinned=adapter in self.pinned))
        self.queue.discard(adapter)
        return self.slots.hold(adapter)

    def release(self, adapter: str) -> None:
        self.slots.release(adapter)

    # -- prefetch ---------------------------------------------------------------------------------

    def hint(self, adapter: str, due: float) -> None:
        """Expect `adapter` to be needed at `due` (time.monotonic seconds)."""
        if self.mode == "prefetch":
            self.queue.hint(adapter, due)

    def read_finished(self) -> bool:
        """A disk read is done and not yet collected (a look at the futures; never waits)."""
        return any(future.done() for future in self._reads.values())

    def tick(self, waiting: list[tuple[str, float]], now: float | None = None) -> None:
        """Once per step, before scheduling: collect finished reads, then (prefetch mode) queue
        the waiting requests' adapters, start disk reads for the soonest needs and start the GPU
        loads the plan allows."""
        for name in list(self._reads):
            self._collect(name)
        if self.mode != "prefetch":
            return
        now = time.monotonic() if now is None else now
        self.queue.expire(before=now - HINT_TTL_S)
        for adapter, due in waiting:
            self.queue.hint(adapter, due)
        for adapter, _ in self.queue.ordered()[: self.host.capacity]:
            known = adapter in self.slots or adapter in self.host or adapter in self._failed
            if not known and not self._start_read(adapter):
                break  # no turn free: the later needs wait behind this one
        view = SlotView(
            free=self.slots.num_free,
            resident=tuple(self.slots.resident),
            evictable=frozenset(self.slots.evictable()),
        )
        loadable = self.host.__contains__
        for load in self.queue.plan(view, max_loads=self.slots.num_slots, loadable=loadable):
            queued = self._queued_bytes()
            if queued and queued + self.host.peek(load.adapter).nbytes > self.copy_window_bytes:
                break  # the load stream is full for now; a need seen later must not queue behind
            if load.evict is not None:
                self.slots.remove(load.evict)
            weights = self.host.get(load.adapter)
            assignment = self.slots.assign(load.adapter, pinned=load.adapter in self.pinned)
            self._upload(load.adapter, weights, assignment)
            self.stats.prefetch_loads += 1

    # -- the forward pass's side ----------------------------------------------------------------

    def layer_waits(self, slots: set[int]) -> list[list[torch.cuda.Event]] | None:
        """Per layer, the load events the forward pass must wait on before using these slots.
        Returned once: after this step's forward has waited on them, later work on the compute
        stream is ordered after the copies."""
        pending = [self._pending.pop(s).events for s in slots if s in self._pending]
        if not pending:
            return None
        return [list(layer) for layer in zip(*pending, strict=True)]

    def mark_used(self, slots: set[int]) -> None:
        """Called once a step's launches are enqueued: record an event after them for the slots
        the step reads. A later copy into one of these slots waits on that event instead of on
        everything enqueued on the compute stream."""
        if self._stream is None or not slots:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.weights.device))
        for slot in slots:
            self._last_use[slot] = event

    # -- internals ------------------------------------------------------------------------------

    def _upload(self, adapter: str, weights: AdapterWeights, assignment) -> None:
        slot = assignment.slot
        self._pending.pop(slot, None)
        if self._stream is not None:
            # The slot's previous adapter may still be read by a step on the compute stream:
            # the copies start after the last step that read it (its event). A step in flight
            # reads only slots its running requests hold, and a held slot is never assigned,
            # so a copy started during a step waits for no part of it.
            last = self._last_use.pop(slot, None)
            if last is not None:
                self._stream.wait_event(last)
        stream = self._stream if self.mode != "blocking" else None
        events = self.weights.write(slot, weights, stream)
        if events:
            copy = Copy(events, weights.nbytes)
            self._pending[slot] = copy
            self._in_flight.append(copy)
        self.stats.gpu_loads += 1

    def _read(self, adapter: str, path: Path) -> AdapterWeights:
        """Disk -> (pinned) host memory. Runs on a worker thread; touches no shared state."""
        try:
            file = read_adapter_file(adapter, path, self.spec, self.max_lora_rank)
        except AdapterError as e:
            raise AdapterLoadError(str(e)) from e
        return self.weights.pack_file(file) if self.on_cuda else file.to_weights(self.dtype)

    def _start_read(self, adapter: str) -> bool:
        """Start reading the adapter unless `read_workers` reads are running (and not stalled,
        READ_STALL_S): then return False, and a later call starts it (`tick` walks the needs
        soonest first; `prepare` retries every step)."""
        if adapter in self._reads:
            return True
        try:
            path = self._path(adapter)
        except AdapterError as e:
            self._failed[adapter] = str(e)
            return True
        now = time.monotonic()
        running = sum(not future.done() and now - self._read_started[name] < READ_STALL_S
                      for name, future in self._reads.items())
        if running >= self.read_workers:
            return False
        self._read_started[adapter] = now
        self._reads[adapter] = self._pool.submit(self._read, adapter, path)
        return True

    def _collect(self, adapter: str) -> bool:
        future = self._reads.get(adapter)
        if future is None or not future.done():
            return False
        del self._reads[adapter]
        try:
            weights = future.result()
        except AdapterLoadError as e:
            self._failed[adapter] = str(e)
            self._read_started.pop(adapter, None)
            self.queue.discard(adapter)
            return False
        self._finish_read(adapter, weights)
        self._record_read(time.monotonic() - self._read_started.pop(adapter))
        return True

    def _record_read(self, seconds: float) -> None:
        self.stats.read_seconds.append(seconds)
        del self.stats.read_seconds[:-256]

    def _finish_read(self, adapter: str, weights: AdapterWeights) -> None:
        self.host.put(adapter, weights, pinned=adapter in self.pinned)
        self.stats.disk_reads += 1

    def status(self) -> dict[str, dict]:
        """Every adapter this replica knows and where it is: "gpu", "loading" (disk read or
        host->GPU copy in flight), "host" or "disk". Not for the hot path (queries events)."""
        names = set(self.paths) | set(self.retired) | set(self.slots.resident) | set(self.host)
        names |= set(self._reads)
        out = {}
        for name in sorted(names):
            slot = self.slots.slot_of(name)
            weights = self.host.peek(name)
            if slot is not None:
                copy = self._pending.get(slot)
                tier = "loading" if copy is not None and not copy.landed() else "gpu"
            elif name in self._reads:
                tier = "loading"
            else:
                tier = "host" if weights is not None else "disk"
            out[name] = {
                "tier": tier,
                "slot": slot,
                "rank": None if weights is None else weights.rank,
                "size_bytes": None if weights is None else weights.nbytes,
                "pinned": name in self.pinned,
                "unloading": name in self.retired,
            }
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _plain_name(name: str) -> bool:
    return "/" not in name and "\\" not in name and name not in ("", ".", "..")
