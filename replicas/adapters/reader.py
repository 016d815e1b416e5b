"""Disk -> host memory: adapter reads on a small pool, one turn at a time, into the host cache.

Reads start soonest need first (the caller walks its needs in that order and stops at the first
that finds no turn: `ReadTurns`). A read runs on a pool thread and touches no shared state; the
engine thread collects it (`collect`), putting the weights in the host cache, or remembering why
it failed until the request that needs it asks (`take_failure`). Only the engine thread calls
into this object.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from replicas.adapters.host_cache import HostCache
from replicas.adapters.loader import AdapterFile, AdapterWeights, read_adapter_file
from replicas.adapters.peft_config import AdapterError
from replicas.adapters.policy import ReadTurns
from replicas.adapters.stats import AdapterStats
from replicas.errors import ErrorKind
from replicas.models.spec import ModelSpec
from replicas.scheduler import AdapterLoadError

# Threads of the read pool: more than the read turns, so that reads past their stall time (a
# hung file system) do not take the threads the next turns need.
READ_THREADS = 4


@dataclass(frozen=True)
class WeightsFromDisk:
    """`(adapter, path) -> AdapterWeights`: read and validate the PEFT files, then `pack` them
    for the slot pool (pinned, in the slot's layout on CUDA). Raises AdapterLoadError."""

    spec: ModelSpec
    max_lora_rank: int
    pack: Callable[[AdapterFile], AdapterWeights]

    def __call__(self, adapter: str, path: Path) -> AdapterWeights:
        try:
            file = read_adapter_file(adapter, path, self.spec, self.max_lora_rank)
        except AdapterError as e:
            raise AdapterLoadError(str(e)) from e
        return self.pack(file)


class AdapterReader:
    def __init__(
        self,
        read_file: Callable[[str, Path], AdapterWeights],
        host: HostCache[AdapterWeights],
        stats: AdapterStats,
        turns: ReadTurns,
        *,
        is_pinned: Callable[[str], bool],
        on_failure: Callable[[str], None] = lambda adapter: None,
    ) -> None:
        self.read_file = read_file  # runs on a pool thread
        self.host = host
        self.stats = stats
        self.turns = turns
        self._is_pinned = is_pinned
        self._on_failure = on_failure  # a read failed (not called for `fail`)
        self._pool = ThreadPoolExecutor(
            max(turns.workers, READ_THREADS), thread_name_prefix="lora-read"
        )
        self._reads: dict[str, Future[AdapterWeights]] = {}
        self._failed: dict[str, tuple[str, ErrorKind]] = {}  # adapter -> (message, kind)

    def __contains__(self, adapter: str) -> bool:
        """A read of the adapter is running or done but not collected."""
        return adapter in self._reads

    def reading(self) -> list[str]:
        return list(self._reads)

    def read_now(self, adapter: str, path: Path) -> None:
        """Read on the calling thread, waiting for it. Raises AdapterLoadError."""
        started = self.turns.clock()
        self._keep(adapter, self.read_file(adapter, path))
        self.stats.record_read(self.turns.clock() - started)

    def start(self, adapter: str, path: Path) -> bool:
        """Start reading the adapter unless every turn is taken: then return False, and a later
        call starts it. True when it is already being read."""
        if adapter in self._reads:
            return True
        running = (name for name, future in self._reads.items() if not future.done())
        if not self.turns.free(running):
            return False
        self.turns.start(adapter)
        self._reads[adapter] = self._pool.submit(self.read_file, adapter, path)
        return True

    def fail(self, adapter: str, message: str, kind: ErrorKind = ErrorKind.INVALID) -> None:
        """Remember that `adapter` cannot be read (e.g. its name no longer resolves, or its
        download failed), and the kind of error its requests get."""
        self._failed[adapter] = (message, kind)

    def failed(self, adapter: str) -> bool:
        return adapter in self._failed

    def take_failure(self, adapter: str) -> tuple[str, ErrorKind] | None:
        """Why the adapter could not be read and the kind of error, once; None if it did not
        fail."""
        return self._failed.pop(adapter, None)

    def finished(self) -> bool:
        """A read is done and not yet collected (a look at the futures; never waits)."""
        return any(future.done() for future in self._reads.values())

    def collect(self, adapter: str) -> bool:
        """True when the adapter's read was done and its weights are now in the host cache."""
        future = self._reads.get(adapter)
        if future is None or not future.done():
            return False
        del self._reads[adapter]
        try:
            weights = future.result()
        except AdapterLoadError as e:
            self._failed[adapter] = (str(e), e.kind)
            self.turns.drop(adapter)
            self._on_failure(adapter)
            return False
        self._keep(adapter, weights)
        self.stats.record_read(self.turns.finish(adapter))
        return True

    def collect_all(self) -> None:
        for adapter in list(self._reads):
            self.collect(adapter)

    def drop(self, adapter: str) -> None:
        """Forget the adapter: its weights, a failure, a read still running (dropped, not
        collected: a later load of the same name may point at another folder)."""
        self.host.remove(adapter)
        self._failed.pop(adapter, None)
        self._reads.pop(adapter, None)
        self.turns.drop(adapter)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _keep(self, adapter: str, weights: AdapterWeights) -> None:
        self.host.put(adapter, weights, pinned=self._is_pinned(adapter))
        self.stats.disk_reads += 1
