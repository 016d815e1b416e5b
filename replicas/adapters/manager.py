"""The engine's adapter manager: name -> version -> host weights -> GPU slot.

A thin facade over parts that each do one job, wired here for the engine:

- `VersionRegistry` (registry.py): names -> versions (folders); register, unregister, retired
  versions. Everything below it, and the requests, go by a version's `key`: unloading a name
  frees it at once, a reload gets new weights under a new key, and the requests holding the old
  key finish on the old weights, whose slot and host memory go with the last of them
  (`attach` and `detach` count the requests on each version).
- `HubFetcher` (fetcher.py): hub -> disk, for adapters named by a hub reference: downloads on
  threads of their own (never a read turn), one per pinned commit.
- `AdapterReader` (reader.py): disk -> pinned host memory (`HostCache`), reads taking turns.
- `Uploader` (uploader.py): host -> GPU slot on the load stream, with per-layer events.
- `SlotPool` (slot_pool.py): which adapter sits in which slot; `PrefetchQueue` (prefetcher.py):
  which adapters to bring in next.
- `CopyBudget` (policy.py): when a copy in flight may join a step, learnt from the steps run.
- `LoadingMode` (modes.py): "blocking", "overlap" or "prefetch", chosen once.

It implements the scheduler's `AdapterGate` (attach, detach, is_resident, prepare, copy_settled,
acquire, release; over keys, which `Request.adapter` holds once queued) and the engine's
per-step hooks: `before_step` (between steps, before scheduling), `start_step` (what the step's
layers wait on), `step_launched` and `poll_during_step` (while the device runs the step),
`after_step` (learn from its time). Only the engine thread calls into this object; the reader's
pool threads only read files.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicas.adapters.fetcher import HubFetcher
from replicas.adapters.host_cache import HostCache
from replicas.adapters.hub import HubAccess, HubRef, download, scrub
from replicas.adapters.layout import check_adapter_files
from replicas.adapters.loader import AdapterWeights
from replicas.adapters.modes import loading_mode
from replicas.adapters.peft_config import AdapterError
from replicas.adapters.policy import READ_WORKERS, CopyBudget, ReadTurns
from replicas.adapters.prefetcher import HINT_TTL_S, PrefetchQueue, prefetch_round  # noqa: F401
from replicas.adapters.reader import AdapterReader, WeightsFromDisk
from replicas.adapters.registry import ServedAdapters, VersionRegistry
from replicas.adapters.slot_pool import SlotPool
from replicas.adapters.stats import AdapterStats
from replicas.adapters.uploader import SlotWeights, Uploader
from replicas.models.spec import ModelSpec
from replicas.scheduler import AdapterLoadError

Need = tuple[str, float]  # (adapter, when it is needed: time.monotonic seconds)


@dataclass(frozen=True)
class StepLoads:
    """What one step's layers wait on for adapter copies."""

    layer_waits: list[list[Any]] | None  # per layer, the load events to wait on (None: none)
    gated: bool  # the layers wait on a copy (on the load stream, or a blocking one ahead)


class AdapterManager:
    def __init__(
        self,
        spec: ModelSpec,
        weights: SlotWeights,
        max_lora_rank: int,
        adapters: dict[str, str],
        adapter_root: str | None,
        max_loaded_loras: int,
        dtype: torch.dtype,
        mode: str = "prefetch",
        pinned: tuple[str, ...] = (),
        read_workers: int = READ_WORKERS,
        eviction_policy: str = "lru",
        max_loaded_bytes: int | None = None,
        hub: HubAccess | None = None,
        fetcher: HubFetcher | None = None,
    ) -> None:
        self.mode = loading_mode(mode)
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.registry = VersionRegistry(adapters, adapter_root, max_lora_rank, pinned)
        self.stats = AdapterStats()
        self.slots = SlotPool(weights.num_slots, eviction_policy)
        self.host: HostCache[AdapterWeights] = HostCache(
            max_loaded_loras, max_loaded_bytes, size=lambda w: w.nbytes
        )
        self.queue = PrefetchQueue(capacity=max(64, 4 * max_loaded_loras))
        on_cuda = weights.device.type == "cuda"
        pack = weights.pack_file if on_cuda else (lambda file: file.to_weights(dtype))
        self.reader = AdapterReader(
            WeightsFromDisk(spec, max_lora_rank, pack),
            self.host,
            self.stats,
            ReadTurns(read_workers),
            is_pinned=self.registry.is_pinned,
            on_failure=self.queue.discard,
        )
        hub = hub if hub is not None else HubAccess()
        self.fetcher = (
            fetcher
            if fetcher is not None
            else HubFetcher(functools.partial(download, access=hub), timeout_s=hub.timeout_s)
        )
        self.uploader = Uploader(weights, self.stats, load_stream=self.mode.load_stream)
        self.budget = CopyBudget()
        self.arrivals = 0  # requests and hints noted so far (`note_arrival`) ...
        self._planned_arrivals = 0  # ... of which the last `tick` had seen this many
        self._launching: set[int] | None = None  # the running step's slots, until launched

    # -- names ------------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The key new requests for `name` go by. Raises AdapterError (404, 400)."""
        return self.registry.resolve(name).key

    def register(self, name: str, path: str | Path, *, pinned: bool = False) -> str:
        """Serve the adapter at `path` as `name` from now on, under a new key (returned). Its
        weights file is checked against the model first, header and layout only
        (`check_adapter_files`). Raises AdapterError (400: bad files or name in use; 404: no
        such folder)."""
        version = self.registry.register(
            name,
            path,
            pinned=pinned,
            check=lambda p: check_adapter_files(name, p, self.max_lora_rank, self.spec),
        )
        if pinned:
            self.hint(version.key, time.monotonic())
        return version.key

    def unregister(self, name: str) -> None:
        """Free `name` at once: new requests get 404, a register makes a new version. Requests
        already holding the old version finish on it, and the last of them to end (`detach`)
        frees its slot and weights; with none, they go now. Raises AdapterError 404 when `name`
        is not served."""
        version = self.registry.unregister(name)
        if version is None:
            return
        self.queue.discard(version.key)
        if version.key in self.slots:
            self.slots.set_pinned(version.key, False)
        if not self.registry.references(version.key):
            self._drop(version.key)

    def served(self) -> ServedAdapters:
        return self.registry.served()

    # -- the scheduler's gate -------------------------------------------------------------------

    def attach(self, adapter: str) -> None:
        """A request on `adapter` was queued: its version stays until the request ends."""
        self.registry.refer(adapter)

    def detach(self, adapter: str) -> None:
        """A request on `adapter` ended (finished, failed or aborted; its slot hold, if any,
        already released). The last one on an unloaded version drops it: its weights, a read in
        flight, its slot."""
        if self.registry.unrefer(adapter):
            self._drop(adapter)

    def is_resident(self, adapter: str) -> bool:
        return adapter in self.slots

    def prepare(self, adapter: str) -> bool:
        """True when the adapter can be placed in a slot now (on the GPU already, or its weights
        in host memory). Otherwise starts reading it and returns False (in blocking mode, reads
        it now). Raises AdapterLoadError when the files turned out unusable."""
        if adapter in self.slots or adapter in self.host:
            return True
        self._raise_failure(adapter)
        if not self.mode.background_reads:
            try:
                path = self._local_path(adapter)
            except AdapterError as e:
                raise AdapterLoadError(str(e), e.kind) from e
            if path is None:  # downloading: never on the step, even in blocking mode
                self._raise_failure(adapter)
                return False
            self.reader.read_now(adapter, path)
            return True
        self._start_read(adapter)
        if self.reader.collect(adapter):
            return True
        self._raise_failure(adapter)
        return False

    def copy_settled(self, adapter: str, prefill_tokens: int = 0) -> bool:
        """No copy of the adapter in flight, or one whose bytes still to land (its own and the
        copies' queued ahead of it) the copy budget admits with `prefill_tokens` of the
        request's prefill, or one whose middle layer has landed. Queries events; never waits."""
        copy = self.uploader.pending(self.slots.slot_of(adapter))
        if copy is None:
            return True
        if self.budget.admits(self.uploader.queued_bytes(through=copy), prefill_tokens):
            return True
        return copy.half_landed()

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
        self._load(adapter, weights)
        self.queue.discard(adapter)
        return self.slots.hold(adapter)

    def release(self, adapter: str) -> None:
        self.slots.release(adapter)

    # -- prefetch -------------------------------------------------------------------------------

    def hint(self, adapter: str, due: float) -> None:
        """Expect `adapter` to be needed at `due` (time.monotonic seconds)."""
        if self.mode.prefetch:
            self.queue.hint(adapter, due)

    def note_arrival(self) -> None:
        """A request or hint arrived: the next mid-step poll plans again."""
        self.arrivals += 1

    def tick(self, waiting: Iterable[Need], now: float | None = None) -> None:
        """Collect finished reads, then (prefetch mode) queue the waiting requests' adapters,
        start disk reads for the soonest needs and start the GPU loads the budget allows."""
        self._planned_arrivals = self.arrivals
        self.fetcher.collect()
        self.reader.collect_all()
        if not self.mode.prefetch:
            return
        self.stats.prefetch_loads += prefetch_round(
            self.queue, self.slots, self.host, self.budget, waiting,
            time.monotonic() if now is None else now,
            known=lambda a: a in self.slots or a in self.host or self.reader.failed(a),
            start_read=self._start_read,
            queued_bytes=self.uploader.queued_bytes,
            load=self._load,
        )  # fmt: skip

    # -- the engine's step ----------------------------------------------------------------------

    def before_step(self, waiting: Callable[[], Iterable[Need]]) -> None:
        """Between steps, before scheduling: `tick` with the waiting requests' needs."""
        self.uploader.new_step()
        self.tick(waiting())

    def start_step(self, slots: set[int]) -> StepLoads:
        """The step reading `slots` is about to launch: what its layers must wait on. The load
        events are handed out once (later work on the compute stream is ordered after them)."""
        waits = self.uploader.layer_waits(slots)
        self._launching = slots
        return StepLoads(waits, waits is not None or self.uploader.loaded_inline())

    def step_launched(self) -> None:
        """Every launch of the step is enqueued: copies into other slots may start now, into
        the step's slots once it is done (an event after it). Once a step; later calls no-op."""
        if self._launching is not None:
            self.uploader.mark_used(self._launching)
            self._launching = None

    def poll_during_step(self, waiting: Callable[[], Iterable[Need]]) -> bool:
        """While the device runs a step (prefetch mode): when a request or hint arrived or a
        disk read finished since the last `tick`, tick again, so their loads start during the
        step. Returns whether polling is worth going on with."""
        if not self.mode.prefetch:
            return False
        if (
            self.arrivals != self._planned_arrivals
            or self.reader.finished()
            or self.fetcher.finished()
        ):
            self.tick(waiting())
        return True

    def after_step(self, loads: StepLoads, elapsed_s: float, prefill_tokens: int) -> None:
        """The step's tokens are back after `elapsed_s`: the copy budget learns from it how
        long a copy can hide behind a step and behind a prefill."""
        self._launching = None
        self.budget.observe_step(elapsed_s, prefill_tokens, loads.gated)

    # -- reporting ------------------------------------------------------------------------------

    def status(self) -> dict[str, dict]:
        """Every adapter this replica knows, by name, and where it is: "gpu", "loading" (disk
        read or host->GPU copy in flight), "host", "disk", or for a hub adapter not on this
        node's disk yet "downloading" or "hub". A name's live version is reported;
        a retired one (`unloading`: requests still running on it) only while the name has no
        live version. Not for the hot path (queries events)."""
        keys = self.registry.keys() | set(self.slots.resident) | set(self.host)
        keys |= set(self.reader.reading())
        out: dict[str, dict] = {}
        for key in sorted(keys):
            name = self.registry.name_of(key)
            retired = self.registry.is_retired(key)
            if name in out and (retired or not out[name]["unloading"]):
                continue
            slot = self.slots.slot_of(key)
            weights = self.host.peek(key)
            if slot is not None:
                copy = self.uploader.pending(slot)
                tier = "loading" if copy is not None and not copy.landed() else "gpu"
            elif key in self.reader:
                tier = "loading"
            elif weights is not None:
                tier = "host"
            else:
                tier = self._disk_tier(key)
            out[name] = {
                "tier": tier,
                "slot": slot,
                "rank": None if weights is None else weights.rank,
                "size_bytes": None if weights is None else weights.nbytes,
                "pinned": self.registry.is_pinned(key),
                "unloading": retired,
            }
        return dict(sorted(out.items()))

    def residency(self) -> dict[str, list[str]]:
        """The adapters new requests may use, by name and tier: "gpu", "loading", "host" (the
        router's view; retired versions left out). `status`'s tiers without its sizes and disk
        lookups: the replica asks for it every 0.1 s, between steps, on the engine thread."""
        tiers: dict[str, list[str]] = {"gpu": [], "loading": [], "host": []}
        resident = self.slots.resident
        for key in set(resident) | set(self.host) | set(self.reader.reading()):
            if self.registry.is_retired(key):
                continue
            slot = resident.get(key)
            if slot is not None:
                copy = self.uploader.pending(slot)
                tier = "loading" if copy is not None and not copy.landed() else "gpu"
            else:
                tier = "loading" if key in self.reader else "host"
            tiers[tier].append(self.registry.name_of(key))
        return {tier: sorted(names) for tier, names in tiers.items()}

    def shutdown(self) -> None:
        self.reader.shutdown()
        self.fetcher.shutdown()

    # -- internals ------------------------------------------------------------------------------

    def _drop(self, key: str) -> None:
        """Forget a retired version no request refers to (no request holds its slot either)."""
        self.registry.drop(key)
        self.reader.drop(key)
        self.queue.discard(key)
        if key in self.slots:
            self.slots.remove(key)

    def _load(self, adapter: str, weights: AdapterWeights) -> None:
        assignment = self.slots.assign(adapter, pinned=self.registry.is_pinned(adapter))
        self.uploader.upload(assignment.slot, weights)

    def _start_read(self, adapter: str) -> bool:
        """Start reading the adapter unless no read turn is free: then return False, and a later
        call starts it (`tick` walks the needs soonest first; `prepare` retries every step)."""
        if adapter in self.reader:
            return True
        try:
            path = self._local_path(adapter)
        except AdapterError as e:
            self.reader.fail(adapter, str(e), e.kind)
            self.queue.discard(adapter)  # as for a failed read: no prefetch retries it
            return True
        if path is None:
            return True  # downloading: no read turn taken, the later needs go on
        return self.reader.start(adapter, path)

    def _local_path(self, adapter: str) -> Path | None:
        """The adapter's folder on this node; None while a hub adapter is downloaded (started
        here if it is not yet). Raises AdapterError: an unknown key, or a download that failed
        (with its kind, while that failure stands)."""
        location = self.registry.path(adapter)
        if isinstance(location, Path):
            return location
        folder = self.fetcher.folder(location)
        if folder is not None:
            return folder
        failure = self.fetcher.failure(location)
        if failure is not None:
            raise AdapterError(failure.message, failure.kind)
        self.fetcher.start(location)
        return None

    def _disk_tier(self, key: str) -> str:
        location = self.registry.path(key)
        if not isinstance(location, HubRef) or self.fetcher.folder(location) is not None:
            return "disk"
        return "downloading" if self.fetcher.downloading(location) else "hub"

    def _raise_failure(self, adapter: str) -> None:
        failure = self.reader.take_failure(adapter)
        if failure is None:
            return
        message, kind = failure
        location = self.registry.path(adapter) if adapter in self.registry.keys() else None
        if isinstance(location, HubRef) and (folder := self.fetcher.folder(location)):
            message = scrub(message, folder, location)  # no path of this node's disk
        raise AdapterLoadError(message, kind)
