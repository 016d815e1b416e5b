"""Where the engine's loop (`replicas.engine_loop.EngineLoop`) runs: the `EngineCore` the
asyncio front (`replicas.async_engine.AsyncEngine`) drives. No asyncio, no Ray.

Two cores, one contract: `ThreadCore` runs the loop on a thread of the caller's process (it
shares that process's GIL with the caller's event loop and, under Serve, Ray's own threads);
`ProcessCore` (`replicas.engine_process`) runs it in a process of its own and exchanges one
message per step. `build_core` picks the one `EngineConfig.engine_process` asks for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.engine_loop import EngineLoop, InboxItem, StepReport, Stop
from replicas.engine_process import ProcessCore

T = TypeVar("T")


class EngineCore(Protocol):
    """Runs one engine's loop. The front posts `InboxItem`s (any thread; in order) and gets
    every `StepReport` through `on_report`, and `on_stopped(why)` once when the loop has ended
    for whatever reason (shutdown, a crash, a dead process), on a thread of the core's (never
    the front's event loop). `alive`: the loop runs and takes work. `last_error`: the last step
    failure, or why the loop ended."""

    def start(
        self, on_report: Callable[[StepReport], None], on_stopped: Callable[[str], None]
    ) -> None: ...

    def post(self, item: InboxItem) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def last_error(self) -> BaseException | None: ...


class _ThreadInbox:
    """`Inbox` fed from any thread of this process."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._wake = threading.Event()

    def put(self, item: InboxItem) -> None:
        self._items.put(item)
        self._wake.set()

    def get_nowait(self) -> InboxItem | None:
        try:
            return self._items.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()  # a wake lost here is harmless: the loop drains right after


class ThreadCore:
    """The loop on a daemon thread of this process; reports are handed over on that thread.
    `engine` is the loop's once started: touch it only through calls (or before `start`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox = _ThreadInbox()
        self._loop: EngineLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crash: BaseException | None = None

    def start(
        self, on_report: Callable[[StepReport], None], on_stopped: Callable[[str], None]
    ) -> None:
        self._loop = EngineLoop(self.engine, self._inbox, on_report)
        self._thread = threading.Thread(
            target=self._run, args=(self._loop, on_stopped), name="lorafleet-engine", daemon=True
        )
        self._thread.start()

    def _run(self, loop: EngineLoop, on_stopped: Callable[[str], None]) -> None:
        why = "the engine stopped"
        try:
            loop.run()
        except BaseException as e:  # a bug in the loop itself: say so, then end every stream
            self._crash = e
            why = f"the engine loop failed: {e!r}"
            raise
        finally:
            on_stopped(why)

    def post(self, item: InboxItem) -> None:
        self._inbox.put(item)

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def last_error(self) -> BaseException | None:
        if self._crash is not None:
            return self._crash
        return self._loop.last_error if self._loop is not None else None


def build_core(
    config: EngineConfig,
    engine_cls: type[Engine] = Engine,
    setup: Callable[[Engine], T] | None = None,
) -> tuple[EngineCore, T | None]:
    """The core `config.engine_process` asks for, its engine built (`engine_cls(config)`) and
    `setup(engine)` run on it before any step; returns the core (not started) and what setup
    returned. A start-up error (a bad model path, setup's own) is raised here."""
    if config.engine_process:
        process = ProcessCore(config, engine_cls, setup)
        return process, process.setup_result  # type: ignore[return-value]  # setup's, pickled
    engine = engine_cls(config)
    return ThreadCore(engine), setup(engine) if setup is not None else None
