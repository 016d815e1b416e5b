"""When a copy may join a step, and when a disk read may start. Plain Python: no torch.

`CopyBudget` -- admission and the load stream's budget. A copy expected to land within
`copy_steps` recent steps (or `short_copy_s`, if longer) never holds a request back: it arrives
layer by layer while the step computes, and stretches the step it joins by at most one step's
time -- what admitting the request a step later would cost that request anyway. "Land" counts
what is still to land of it and of the copies queued ahead of it (the load stream runs its copies
one after another, each layer by layer; a copy started during the last step is partly there). The
same window bounds what the prefetcher queues on the load stream, so a need that shows up later
waits behind at most that. A request's own prefill widens the window by the time its tokens add
to the step: the layers of a long prompt take about as long as a large copy, so the copy lands
under them. The step costs are learnt from the steps the engine runs (`observe_step`).

`ReadTurns` -- disk reads take turns. One read already spreads its file ranges and layers over
the host threads (adapters/host_threads.py), and reads at once share the host's memory bandwidth
(docs/perf/adapter_churn.md), so more readers only delay the soonest need. A read running longer
than `stall_s` no longer holds its turn, so a file on a hung file system does not stop every
other adapter's read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

SHORT_COPY_S = 0.005
COPY_STEPS = 2.0
STEP_COST_EMA = 0.2  # weight of the newest step in the step-cost averages
# A step's prefill tokens teach the per-token cost only from this many on: below it the step's
# fixed costs swamp them.
PREFILL_COST_MIN_TOKENS = 64
# Pinned host -> GPU over PCIe 5, a little under the rate copies reach (docs/perf/adapter_churn.md).
COPY_BYTES_PER_S = 50e9
READ_WORKERS = 1  # disk reads running at once
READ_STALL_S = 5.0


class CopyBudget:
    """The step-cost model and the copy window it sets. Only the engine thread uses it."""

    def __init__(
        self,
        short_copy_s: float = SHORT_COPY_S,
        copy_steps: float = COPY_STEPS,
        copy_bytes_per_s: float = COPY_BYTES_PER_S,
    ) -> None:
        self.short_copy_s = short_copy_s
        self.copy_steps = copy_steps
        self.copy_bytes_per_s = copy_bytes_per_s
        self.step_time_s = 0.0  # recent model step time
        self.decode_step_s = 0.0  # recent time of a step with no prefill that waited on no copy
        self.prefill_token_s = 0.0  # recent time one prefill token adds to a step

    @property
    def window_bytes(self) -> float:
        """What the load stream moves in `copy_steps` recent steps (at least `short_copy_s`)."""
        return max(self.short_copy_s, self.copy_steps * self.step_time_s) * self.copy_bytes_per_s

    def admits(self, bytes_to_land: float, prefill_tokens: int = 0) -> bool:
        """A copy with `bytes_to_land` still ahead of its end (its own and the copies' queued
        before it) may join a step that prefills `prefill_tokens` of its request."""
        prefill_bytes = prefill_tokens * self.prefill_token_s * self.copy_bytes_per_s
        return bytes_to_land <= self.window_bytes + prefill_bytes

    def may_queue(self, queued_bytes: float, nbytes: int) -> bool:
        """The prefetcher may add a copy of `nbytes` behind `queued_bytes` still to land: an
        empty load stream takes any copy, a busy one only up to the window."""
        return not queued_bytes or queued_bytes + nbytes <= self.window_bytes

    def observe_step(self, elapsed_s: float, prefill_tokens: int, gated: bool) -> None:
        """Learn from one model step: its time, and unless it waited on a copy (`gated`), what a
        decode step costs and what a prefill token adds to one (the step's time beyond a decode
        step's, per prefill token)."""
        self.step_time_s += STEP_COST_EMA * (elapsed_s - self.step_time_s)
        if gated:
            return
        if prefill_tokens == 0:
            self.decode_step_s += STEP_COST_EMA * (elapsed_s - self.decode_step_s)
        elif prefill_tokens >= PREFILL_COST_MIN_TOKENS and self.decode_step_s > 0:
            per_token = max(0.0, elapsed_s - self.decode_step_s) / prefill_tokens
            self.prefill_token_s += STEP_COST_EMA * (per_token - self.prefill_token_s)


class ReadTurns:
    """Which reads hold a turn: at most `workers` started less than `stall_s` ago and not done.
    The caller says which reads are done; `clock` is time.monotonic unless a test passes one."""

    def __init__(
        self,
        workers: int = READ_WORKERS,
        stall_s: float = READ_STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if workers < 1:
            raise ValueError("reads need at least one turn")
        self.workers = workers
        self.stall_s = stall_s
        self.clock = clock
        self._started: dict[str, float] = {}

    def free(self, running: Iterable[str]) -> bool:
        """A turn is free, given the started reads not yet done (`running`)."""
        now = self.clock()
        holding = sum(now - self._started[name] < self.stall_s for name in running)
        return holding < self.workers

    def start(self, name: str) -> None:
        self._started[name] = self.clock()

    def finish(self, name: str) -> float:
        """The read is over: returns how long it ran."""
        return self.clock() - self._started.pop(name)

    def drop(self, name: str) -> None:
        self._started.pop(name, None)
