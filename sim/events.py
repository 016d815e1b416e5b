"""The virtual clock: an event queue of callbacks in time order. Ties run in the order they
were scheduled, so a run is deterministic."""

from __future__ import annotations

import heapq
import inspect
import itertools
from collections.abc import Callable, Generator
from typing import Any

Process = Generator[float, None, None]  # yields how long to wait before it goes on


class EventLoop:
    """`at(t, fn, *args)` runs `fn(*args)` when the clock reaches `t`; `now()` is the clock
    (pass the bound method wherever real code takes a `clock`)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if t < self._now:
            raise ValueError(f"an event in the past: {t} < {self._now}")
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self._now + max(0.0, delay_s), fn, *args)

    def spawn(self, make: Callable[[Task], Process]) -> Task:
        """Run `make(task)`, a generator, as a task from the next turn of the loop on (as
        asyncio.create_task): each `yield delay` waits that long on the clock. The process gets
        its own task (to know itself, as asyncio.current_task)."""
        task = Task()
        task.process = make(task)
        self.after(0.0, self._resume, task)
        return task

    def _resume(self, task: Task) -> None:
        if task.done or task.process is None:
            return
        try:
            delay = next(task.process)
        except StopIteration:
            task.done = True
            return
        self.after(delay, self._resume, task)

    def run(self, until: Callable[[], bool] = lambda: False, max_t: float = float("inf")) -> None:
        """Run events in time order until `until()` holds, none are left or `max_t` is passed."""
        while self._queue and not until():
            t, _, fn, args = self._queue[0]
            if t > max_t:
                return
            heapq.heappop(self._queue)
            self._now = t
            fn(*args)


class Task:
    """A spawned process; `cancel()` stops it at its next wake-up (asyncio's task.cancel)."""

    def __init__(self) -> None:
        self.process: Process | None = None
        self.done = False

    def cancel(self) -> None:
        if self.done:
            return
        self.done = True
        process = self.process
        if process is not None and inspect.getgeneratorstate(process) != inspect.GEN_RUNNING:
            process.close()
