"""An asyncio event loop on a virtual clock, for tests of timings: whenever nothing is ready to
run, the clock jumps to the next timer. Sleeps take no real time, and a duration read off the
loop's clock is exactly what the code under test waited for, however loaded the machine (a
real clock adds whatever the machine was busy with: a test bound on it is a guess). Only for
code that waits on timers and on itself: a socket or another thread is waited for in real time,
and the clock stands still meanwhile."""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None):
        if timeout is None:  # no timer at all: only another thread can wake the loop
            return super().select(None)
        events = super().select(0)
        if not events:
            self._clock[0] += timeout  # straight to the next timer (0: something is ready)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = [0.0]
        super().__init__(_JumpingSelector(self._now))

    def time(self) -> float:
        return self._now[0]
