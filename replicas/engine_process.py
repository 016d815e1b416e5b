"""`ProcessCore`: the engine's loop (`replicas.engine_loop.EngineLoop`) in a child process of
its own, so that it shares no GIL with the replica's event loop and Ray's threads. Plain Python
and multiprocessing (the `spawn` context), no Ray.

The child builds the `Engine` from the (frozen, picklable) `EngineConfig` and the engine class,
runs `setup` on it, says it is ready (or sends its start-up error), then runs the loop: inbox
items come over one pipe, and each `StepReport` goes back over another as one message, a step's
outputs all in it. The parent keeps everything that touches asyncio (streams, channels, the
chunk pacing): a reader thread here receives the reports and hands them to the front.

Lifecycle: the child dies with the parent (PR_SET_PDEATHSIG on Linux, set against the reader
thread that started it, which lives as long as the child; and EOF on its inbox pipe, read as
Stop). When the child dies, the reader sees EOF on the report pipe and the core stops
(`on_stopped`): `alive` turns False, and the front ends every stream and pending call.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.engine_loop import EngineLoop, EngineStopped, InboxItem, StepReport, Stop

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0  # how long `shutdown` waits for the child before killing it
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# A post blocks its caller (an event loop) while the inbox pipe is full: the child takes only
# requests and hints mid-step, so the rest waits out a step there. 1 MiB (Linux's default most
# for a pipe; 64 KiB otherwise) holds a step's worth of posts with room to spare.
INBOX_PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class _Ready:
    setup_result: object


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class ProcessCore:
    """`EngineCore` over a child process. The constructor starts the child and returns once its
    engine is built and `setup(engine)` ran (`setup_result` holds what it returned), or raises
    the child's start-up error. `setup`, the engine class, every call's `fn` and its arguments
    and results cross a pipe: they must pickle (module-level functions, not lambdas)."""

    def __init__(
        self,
        config: EngineConfig,
        engine_cls: type[Engine] = Engine,
        setup: Callable[[Engine], object] | None = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        inbox_out, self._inbox = context.Pipe(duplex=False)
        _widen(self._inbox)
        self._reports, reports_in = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main,
            # torch's intra-op threads as this process has them (what the replica was given,
            # e.g. Ray's OMP_NUM_THREADS), as the engine on a thread here would run with.
            args=(
                config, engine_cls, setup, inbox_out, reports_in, os.getpid(),
                torch.get_num_threads(),
            ),  # fmt: skip
            name="lorafleet-engine",
            daemon=True,  # killed at this interpreter's exit, should the pipes not end it
        )
        self._child_ends = (inbox_out, reports_in)
        self._send_lock = threading.Lock()  # posts come from several threads
        self._ready = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.setup_result: object = None
        self._on_report: Callable[[StepReport], None] | None = None
        self._on_stopped: Callable[[str], None] | None = None
        self._running = False
        self._stopping = False
        self._last_error: BaseException | None = None
        # The reader thread starts the child: PR_SET_PDEATHSIG fires when the thread that
        # forked the child ends, and this one ends only once the child is gone.
        self._reader = threading.Thread(
            target=self._read, name="lorafleet-engine-reader", daemon=True
        )
        self._reader.start()
        self._ready.wait()
        if self._start_error is not None:
            self._reader.join()
            raise self._start_error

    def start(
        self, on_report: Callable[[StepReport], None], on_stopped: Callable[[str], None]
    ) -> None:
        self._on_report, self._on_stopped = on_report, on_stopped
        self._started.set()

    def post(self, item: InboxItem) -> None:
        """Raises what pickling `item` raises (a call's unpicklable `fn`); a dead child's
        broken pipe is not the caller's: the reader announces the death."""
        data = pickle.dumps(item, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self._inbox.send_bytes(data)
            except OSError:
                pass

    def shutdown(self) -> None:
        self._stopping = True
        self.post(Stop())
        self._started.set()  # a core never started still reads until the child ends
        self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine process did not stop; killing it")
            self._process.kill()
            self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._inbox.close()

    @property
    def alive(self) -> bool:
        return self._running and self._started.is_set() and not self._stopping

    @property
    def last_error(self) -> BaseException | None:
        return self._last_error

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _read(self) -> None:
        """The reader thread: start the child, wait for it to be ready, then hand each report
        to the front until the child is gone."""
        try:
            self._process.start()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        for end in self._child_ends:  # the child's now: EOF here must mean the child ended
            end.close()
        try:
            first = self._reports.recv()
        except (EOFError, OSError):
            first = _Failed(RuntimeError(self._exit_message("before its engine was ready")))
        if isinstance(first, _Failed):
            self._start_error = first.error
            self._process.join(timeout=SHUTDOWN_TIMEOUT_S)
            self._ready.set()
            return
        self.setup_result = first.setup_result
        self._running = True
        self._ready.set()
        self._started.wait()
        why = "the engine stopped"
        try:
            while True:
                report = self._reports.recv()
                if report.error is not None:
                    self._last_error = report.error
                if self._on_report is not None:
                    self._on_report(report)
        except (EOFError, OSError):
            if not self._stopping:
                why = self._exit_message("while serving")
                self._last_error = EngineStopped(why)
                logger.error("%s", why)
        except Exception as e:  # a bug in the front's delivery: the child must not outlive it
            logger.exception("handing an engine report over failed; stopping the engine")
            why = f"the engine's reports could not be delivered: {e!r}"
            self._last_error = e
            self._process.kill()
        finally:
            self._running = False
            self._process.join(timeout=SHUTDOWN_TIMEOUT_S)
            if self._on_stopped is not None:
                self._on_stopped(why)

    def _exit_message(self, when: str) -> str:
        self._process.join(timeout=5.0)
        return f"the engine process exited {when} (exit code {self._process.exitcode})"


def _child_main(
    config: EngineConfig,
    engine_cls: type[Engine],
    setup: Callable[[Engine], object] | None,
    inbox: Connection,
    reports: Connection,
    parent_pid: int,
    torch_threads: int,
) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(torch_threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s"
    )
    try:
        engine = engine_cls(config)
        result = setup(engine) if setup is not None else None
    except BaseException as e:
        reports.send(_Failed(_portable(e)))
        return
    result, error = _portable_result(result, None)
    # What start-up made (torch, the model, the warm-up) goes to the permanent generation, so
    # the loop's collections never walk it: a full one over the imports alone took 130 ms on a
    # 2-core CPU, a stall of every running request. Serve does the same to replica processes
    # (RAY_SERVE_FREEZE_GC_ON_STARTUP); this child is ours.
    gc.collect()
    gc.freeze()
    reports.send(_Ready(result) if error is None else _Failed(error))
    loop = EngineLoop(engine, _PipeInbox(inbox), lambda report: _send_report(reports, report))
    try:
        loop.run()
    finally:
        engine.shutdown()


def _widen(conn: Connection) -> None:
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        try:
            fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, INBOX_PIPE_BYTES)
        except OSError:  # above the system's pipe-max-size: keep the default
            pass


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when its parent (the thread that started it) ends; and if
    the parent is gone already, go."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


class _PipeInbox:
    """`Inbox` over the pipe from the parent. The parent's end closing (it died, or shut the
    core) reads as Stop."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def get_nowait(self) -> InboxItem | None:
        try:
            if not self._conn.poll():
                return None
            return self._conn.recv()
        except (EOFError, OSError):
            return Stop()

    def wait(self, timeout_s: float) -> None:
        try:
            self._conn.poll(timeout_s)
        except (EOFError, OSError):
            pass  # get_nowait says Stop


def _send_report(reports: Connection, report: StepReport) -> None:
    """One message. Call answers and step errors are made portable first (what fails to pickle
    or unpickle becomes a RuntimeError of its text), so that one bad answer never loses a step's
    outputs."""
    if report.settled:
        report.settled = [
            (call_id, *_portable_result(result, error)) for call_id, result, error in report.settled
        ]
    if report.error is not None:
        report.error = _portable(report.error)
    reports.send(report)


def _portable_result(
    result: object, error: BaseException | None
) -> tuple[object, BaseException | None]:
    """(result, error) as they will arrive in the parent."""
    try:
        return pickle.loads(pickle.dumps((result, error), pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        if error is not None:
            return None, _portable(error)
        return None, RuntimeError(f"the engine's answer did not cross processes: {e!r}")


def _portable(error: BaseException) -> BaseException:
    try:
        return pickle.loads(pickle.dumps(error, pickle.HIGHEST_PROTOCOL))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
