"""The engine's busy loop, wherever it runs (a thread, or a process of its own; see
`replicas.engine_core`). No asyncio, no Ray.

`EngineLoop.run` owns the `Engine`: only the thread that runs it touches the engine. Work comes
in through an `Inbox` (requests, hints, aborts, calls, stop), in order; results go out as
`StepReport`s through `report`, one after the inbox is drained between steps (when it had
something to say: a call's answer, a request refused) and one after each step (its outputs).
New requests and prefetch hints are taken in while a step runs too (`Engine.step`'s `on_idle`),
so their adapters start loading at once; everything else in the inbox (aborts, calls, stop), and
whatever was posted after it, waits for the step to end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from replicas.engine import Engine, RequestRejected
from replicas.errors import ErrorKind, ServingError
from replicas.protocol import EngineError, GenerateRequest
from replicas.request import Request, RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # an idle loop looks at its inbox at least this often
STALLED_WAIT_S = 0.001  # only adapter reads in flight: the back-off between steps


class EngineStopped(ServingError, RuntimeError):
    """The engine's loop is gone (stopped, or its process died): what a pending `call` raises."""

    default_kind = ErrorKind.UNAVAILABLE


# The inbox's items: posted by the engine's front (`AsyncEngine`), taken by the loop. Plain
# data, picklable when the loop runs in a process of its own (a call's `fn` and `args` too).
@dataclass(frozen=True)
class Add:
    request: GenerateRequest


@dataclass(frozen=True)
class Hints:
    hints: list[tuple[str, float]]


@dataclass(frozen=True)
class Call:
    call_id: int  # the front's: its answer comes back in `StepReport.settled` under this id
    fn: Callable[..., object]  # run as fn(engine, *args) between steps
    args: tuple[object, ...]


@dataclass(frozen=True)
class Abort:
    request_id: str
    message: str | None  # for the error chunk that ends the stream; None: its caller closed it


@dataclass(frozen=True)
class Stop:
    """Between steps: the loop returns (what was posted before it is done first)."""


InboxItem = Add | Hints | Call | Abort | Stop


class Inbox(Protocol):
    """Where the loop takes its work from, in the order it was posted. Only the loop's thread
    calls these."""

    def get_nowait(self) -> InboxItem | None:
        """The next item, or None when there is none now."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Return when an item may have been posted, or after `timeout_s`."""
        ...


@dataclass
class StepReport:
    """What the loop has to say at one point: between steps (`stepped` False), or after a step
    with all its outputs. The counters are totals since the loop started. Sent as one message
    when the loop runs in its own process."""

    stepped: bool
    # The step's outputs: those that only carry tokens as (request id, token ids, prompt
    # tokens) in `tokens` (nearly all of them; a tuple pickles about six times faster than a
    # RequestOutput, and in its own process the loop pickles a report after every step), the
    # rest (a request's end or failure) in `outputs`. A request has at most one of either.
    outputs: list[RequestOutput] = field(default_factory=list)
    tokens: list[tuple[str, list[int], int]] = field(default_factory=list)
    errors: list[tuple[str, EngineError]] = field(default_factory=list)  # streams to end so
    settled: list[tuple[int, object, BaseException | None]] = field(default_factory=list)
    num_aborted: int = 0  # live requests aborted (caller closed, or abandoned)
    step_cpu_s: float = 0.0  # the loop thread's CPU time inside steps
    error: BaseException | None = None  # the step failure behind this report's outputs


def split_outputs(
    outputs: list[RequestOutput],
) -> tuple[list[RequestOutput], list[tuple[str, list[int], int]]]:
    """A step's outputs as `StepReport` carries them: those with an end, an error or metrics,
    and the rest as (request id, token ids, prompt tokens)."""
    full: list[RequestOutput] = []
    tokens: list[tuple[str, list[int], int]] = []
    for output in outputs:
        if output.finish_reason is None and output.error is None and output.metrics is None:
            tokens.append((output.request_id, output.new_token_ids, output.num_prompt_tokens))
        else:
            full.append(output)
    return full, tokens


class EngineLoop:
    """`run()` steps `engine` while it has work, taking work from `inbox` between steps (and
    requests and hints during them), and hands every `StepReport` to `report`, on the loop's
    thread. A step that raises fails every request in flight (`Engine.abort_all`) and the loop
    goes on; `last_error` keeps the exception."""

    def __init__(self, engine: Engine, inbox: Inbox, report: Callable[[StepReport], None]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.report = report
        self.num_aborted = 0
        self.step_cpu_s = 0.0
        self.last_error: BaseException | None = None
        self._held: InboxItem | None = None  # taken from the inbox mid-step, not run
        self._stopped = False
        self._pending = StepReport(stepped=False)  # what the next report carries
        self._reported_aborted = 0
        self._flowing = False  # the last step had outputs: an empty one is news too

    def run(self) -> None:
        while True:
            self.drain_inbox()
            self._flush()
            if self._stopped:
                return
            if not self.engine.has_work:
                self.inbox.wait(IDLE_WAIT_S)
                continue
            cpu = time.thread_time()
            try:
                outputs = self.engine.step(on_idle=self.take_intake)
            except Exception as e:  # a bug or device error must not leave callers hanging
                logger.exception("engine step failed; failing the requests in flight")
                self.last_error = self._pending.error = e
                outputs = self.engine.abort_all(f"internal engine error: {e}")
            self.step_cpu_s += time.thread_time() - cpu
            self._pending.stepped = True
            self._pending.outputs, self._pending.tokens = split_outputs(outputs)
            self._flush()
            if self.engine.stalled:  # only adapter reads are in flight: don't spin
                self.inbox.wait(STALLED_WAIT_S)

    def take_intake(self) -> None:
        """Mid-step: take the requests and hints at the head of the inbox, in order, up to the
        first other item (held for `drain_inbox`, with everything behind it)."""
        self.drain_inbox(mid_step=True)

    def drain_inbox(self, mid_step: bool = False) -> None:
        while not self._stopped:
            item: InboxItem | None = self._held
            if item is not None:
                if mid_step:
                    return
                self._held = None
            else:
                item = self.inbox.get_nowait()
                if item is None:
                    return
            if isinstance(item, Add):
                self._add(item.request)
            elif isinstance(item, Hints):
                for adapter, eta_s in item.hints:
                    self.engine.prefetch_hint(adapter, eta_s)
            elif mid_step:
                self._held = item
                return
            elif isinstance(item, Call):
                try:
                    result = item.fn(self.engine, *item.args)
                except Exception as e:
                    self._pending.settled.append((item.call_id, None, e))
                else:
                    self._pending.settled.append((item.call_id, result, None))
            elif isinstance(item, Abort):
                self._abort(item.request_id, item.message)
            else:
                self._stopped = True

    def _add(self, request: GenerateRequest) -> None:
        try:
            self.engine.add_request(
                Request(
                    request.request_id,
                    list(request.prompt_token_ids),
                    request.sampling,
                    request.adapter,
                )
            )
        except RequestRejected as e:
            self._pending.errors.append((request.request_id, EngineError.of(e)))
        except ValueError as e:
            self._pending.errors.append((request.request_id, EngineError(str(e))))

    def _abort(self, request_id: str, message: str | None) -> None:
        if self.engine.abort(request_id) is None:  # unknown, or finished already
            return
        self.num_aborted += 1
        logger.debug("aborted request %s", request_id)
        if message is not None:
            error = EngineError(message, ErrorKind.UNAVAILABLE)
            self._pending.errors.append((request_id, error))

    def _flush(self) -> None:
        """Hand the pending report out when it carries news: outputs, errors, answers, an abort,
        or the first empty step after steps with outputs (streams stopped flowing)."""
        pending = self._pending
        news = bool(pending.outputs or pending.tokens or pending.errors or pending.settled)
        news |= self.num_aborted != self._reported_aborted
        news |= pending.stepped and self._flowing
        if pending.stepped:
            self._flowing = bool(pending.outputs or pending.tokens)
        self._pending = StepReport(stepped=False)
        if not news:
            return
        pending.num_aborted = self._reported_aborted = self.num_aborted
        pending.step_cpu_s = self.step_cpu_s
        self.report(pending)
