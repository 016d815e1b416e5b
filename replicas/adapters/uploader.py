"""Host -> GPU slot: adapter copies on the load stream, and the events that order them.

Each copy is enqueued on the load stream layer by layer, non-blocking from pinned host memory,
with an event after each layer (`Copy`). The forward pass of layer L waits on event L only
(`layer_waits`), so a step can start while later layers still arrive. A copy into a slot waits
for the last step that read the slot's previous adapter (`mark_used`), not for everything on the
compute stream. Without the load stream (blocking loads, or CPU) copies run on the current
stream, ahead of the step. Only the engine thread calls into this object; nothing here waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from replicas.adapters.loader import AdapterFile, AdapterWeights
from replicas.adapters.stats import AdapterStats


class SlotWeights(Protocol):
    """The device buffers an adapter is copied into (`replicas.lora.LoraWeightPool`)."""

    device: torch.device
    num_slots: int

    def write(
        self, slot: int, weights: AdapterWeights, stream: torch.cuda.Stream | None = None
    ) -> list[Any] | None:
        """Copy `weights` into `slot`; with a stream, enqueue there and return one event per
        layer, in layer order."""

    def pack_file(self, file: AdapterFile) -> AdapterWeights:
        """`file`'s weights packed for `write`; reader threads call it (CUDA pools only)."""


@dataclass
class Copy:
    """One adapter's host->GPU copy on the load stream: an event per layer, in layer order."""

    events: list  # torch.cuda.Event, recorded on the load stream after each layer's copy
    nbytes: int

    def landed(self) -> bool:
        return self.events[-1].query()

    def half_landed(self) -> bool:
        return self.events[len(self.events) // 2].query()

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


class Uploader:
    def __init__(self, pool: SlotWeights, stats: AdapterStats, *, load_stream: bool) -> None:
        self.pool = pool
        self.stats = stats
        on_cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(pool.device) if on_cuda else None
        self._copy_stream = self._stream if load_stream else None
        self._on_compute_stream = not load_stream  # (on CPU every copy is inline, gating none)
        # slot -> the copy into it that no step has waited on yet
        self._pending: dict[int, Copy] = {}
        # every copy on the load stream not yet seen to land, in stream order
        self._in_flight: deque[Copy] = deque()
        # slot -> an event after the last step that read it: a copy into the slot waits for
        # that step only, so it may start while a later step runs
        self._last_use: dict[int, torch.cuda.Event] = {}
        self._inline_loads = False  # a blocking copy was enqueued since `new_step`

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The load stream (None on CPU)."""
        return self._stream

    def upload(self, slot: int, weights: AdapterWeights) -> None:
        """Copy `weights` into `slot`, which no running request holds."""
        self._pending.pop(slot, None)
        if self._stream is not None:
            # The slot's previous adapter may still be read by a step on the compute stream:
            # the copies start after the last step that read it (its event). A step in flight
            # reads only slots its running requests hold, and a held slot is never assigned,
            # so a copy started during a step waits for no part of it.
            last = self._last_use.pop(slot, None)
            if last is not None:
                self._stream.wait_event(last)
        events = self.pool.write(slot, weights, self._copy_stream)
        if events:
            copy = Copy(events, weights.nbytes)
            self._pending[slot] = copy
            self._in_flight.append(copy)
        if self._on_compute_stream:
            self._inline_loads = True
        self.stats.gpu_loads += 1

    def pending(self, slot: int | None) -> Copy | None:
        """The copy into `slot` that no step has waited on yet."""
        return None if slot is None else self._pending.get(slot)

    def queued_bytes(self, through: Copy | None = None) -> int:
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

    def new_step(self) -> None:
        """A step begins: blocking copies from now on run ahead of it (`loaded_inline`)."""
        self._inline_loads = False

    def loaded_inline(self) -> bool:
        """A blocking copy was enqueued since `new_step`: the step's layers queue behind it."""
        return self._inline_loads

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
        event.record(torch.cuda.current_stream(self.pool.device))
        for slot in slots:
            self._last_use[slot] = event
