"""Count the host's waits on the device, by kind, made on one thread.

`torch.cuda.set_sync_debug_mode("error")` refuses blocking copies and stream or device
synchronizations, but lets `Event.synchronize()` through and does not see the caching
allocator's own synchronizing calls. `HostWaits` counts those too: torch's GPU trace callbacks
(`torch.cuda._gpu_trace`; torch fires them from C++ once `torch._C._activate_gpu_trace()` has
run) for event, stream and device synchronizations, and the allocator's statistics for
`cudaFree` and its synchronize-every-stream path. Waits made on other threads (the adapter
reader's pool) are counted apart: the step path is the thread that entered.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.cuda import _gpu_trace

# Caching allocator counters whose every increment made the host wait for the device.
ALLOCATOR_WAITS = ("num_sync_all_streams", "num_device_free")


def allocator_waits() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_WAITS}


class HostWaits:
    """While inside: `events[handle]` counts synchronizations on each CUDA event (by its
    `cuda_event` handle), `streams` and `devices` the stream and device synchronizations, all
    on the entering thread; `elsewhere` those on other threads. After exit, `allocator` holds
    the allocator's synchronizing calls made meanwhile (from any thread)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.events: Counter[int] = Counter()
        self.streams = 0
        self.devices = 0
        self.elsewhere: Counter[str] = Counter()
        self.allocator: dict[str, int] = {}
        self._callbacks = [
            (_gpu_trace.EventSynchronizationCallbacks, self._on_event),
            (_gpu_trace.StreamSynchronizationCallbacks, self._on_stream),
            (_gpu_trace.DeviceSynchronizationCallbacks, self._on_device),
        ]

    def __enter__(self) -> HostWaits:
        torch._C._activate_gpu_trace()  # stays on for the process; our callbacks go on exit
        for registry, callback in self._callbacks:
            registry.add_callback(callback)
        self._allocator_before = allocator_waits()
        return self

    def __exit__(self, *exc) -> None:
        for registry, callback in self._callbacks:
            registry.callback_list.remove(callback)
        after = allocator_waits()
        self.allocator = {k: after[k] - self._allocator_before[k] for k in ALLOCATOR_WAITS}

    def total(self, except_event: int | None = None) -> int:
        """Waits on this thread, leaving out those on the event `except_event`."""
        events = sum(n for handle, n in self.events.items() if handle != except_event)
        return events + self.streams + self.devices

    def _here(self, kind: str) -> bool:
        if threading.get_ident() == self.thread:
            return True
        self.elsewhere[kind] += 1
        return False

    def _on_event(self, handle: int) -> None:
        if self._here("event"):
            self.events[handle] += 1

    def _on_stream(self, handle: int) -> None:
        if self._here("stream"):
            self.streams += 1

    def _on_device(self) -> None:
        if self._here("device"):
            self.devices += 1
