"""Progress on stderr: a one-line text bar."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

from loadgen.records import RequestRecord


class Progress(Protocol):
    def update(self, record: RequestRecord) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def update(self, record: RequestRecord) -> None:
        pass

    def close(self) -> None:
        pass


class TextBar:
    """`[#########...........]  45/100  ok 44  failed 1  12.3 s`, redrawn at most 10 times a
    second and once at the end."""

    WIDTH = 30

    def __init__(self, total: int, label: str = "", out: TextIO = sys.stderr) -> None:
        self.total = total
        self.label = label
        self.out = out
        self.ok = self.failed = 0
        self.start = self.last_draw = time.monotonic()

    def update(self, record: RequestRecord) -> None:
        self.ok += record.ok
        self.failed += not record.ok
        now = time.monotonic()
        if now - self.last_draw >= 0.1 or self.ok + self.failed == self.total:
            self.last_draw = now
            self._draw(now)

    def close(self) -> None:
        self._draw(time.monotonic())
        self.out.write("\n")
        self.out.flush()

    def _draw(self, now: float) -> None:
        done = self.ok + self.failed
        filled = self.WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.out.write(
            f"\r{self.label}[{bar}] {done:>{len(str(self.total))}}/{self.total}"
            f"  ok {self.ok}  failed {self.failed}  {now - self.start:.1f} s"
        )
        self.out.flush()


def make_progress(total: int, label: str = "", enabled: bool = True) -> Progress:
    return TextBar(total, label) if enabled else NoProgress()
