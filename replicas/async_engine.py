"""The asyncio front of an engine: streams results to asyncio callers. No Ray.

The engine runs its own loop (`replicas.engine_loop.EngineLoop`) on an `EngineCore`
(`replicas.engine_core`): a thread of this process, or a process of its own. Callers hand it
work through the core's inbox (add, abort, hint, call); each step's results come back as one
`StepReport`, handed over on a thread of the core's (the engine thread, or the reader thread of
the engine process) and delivered here to one asyncio queue per request, with
`call_soon_threadsafe` on the caller's event loop. When the core stops (shutdown, or its process
died), every live stream ends with an UNAVAILABLE error chunk and every pending call raises
`EngineStopped`.

A caller may open a channel (`open_channel(key)`): while it is open, the tokens of that caller's
requests after their first go into the channel, merged per request, and leave it as one batch
an interval (`Channel.batches`) instead of one chunk per request; a request's first and last
chunks still go to its own stream. Closing the channel hands what it holds back to the
requests' streams.

The interval is `stream_interval_s`, or longer when the replica's streams would otherwise send
more than `max_chunks_per_s` chunks a second in all (`chunk_interval`): every chunk costs about
the same in Serve's proxy whatever it carries, and a node has one proxy for all its replicas.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from replicas.engine_core import EngineCore
from replicas.engine_loop import Abort, Add, Call, EngineStopped, Hints, StepReport
from replicas.errors import ErrorKind
from replicas.protocol import EngineError, GenerateChunk, GenerateRequest
from replicas.request import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

# After its first token, a stream's tokens go out at most once per interval (its last at once).
# Every chunk costs a Ray streaming item here, in the ingress and in Serve's proxy: on a 2-core
# CPU about 2 ms of CPU over the three, against 12 ms a request (benchmarks/bench_serve --timed,
# docs/perf/serving.md). Ray Serve LLM batches at 50 ms too, flushing the first token at once.
STREAM_INTERVAL_S = 0.05
MAX_CHUNK_INTERVAL_S = 0.5  # the longest `chunk_interval` stretches to, whatever the cap


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    channel_key: str | None = None  # whose channel its later tokens may take
    emitted: int = 0  # tokens handed out so far; the core's report thread


class _Held:
    """A request's tokens waiting in a channel, appended to at each step; made a chunk when the
    channel sends them."""

    __slots__ = ("num_prompt_tokens", "request_id", "start", "token_ids")

    def __init__(self, request_id: str, start: int, token_ids: list[int], num_prompt_tokens: int):
        self.request_id = request_id
        self.start = start
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens

    @classmethod
    def of(cls, chunk: GenerateChunk) -> _Held:
        return cls(chunk.request_id, chunk.start, list(chunk.token_ids), chunk.num_prompt_tokens)

    def chunk(self) -> GenerateChunk:
        return GenerateChunk(
            self.request_id, self.token_ids, None, self.num_prompt_tokens, start=self.start
        )


class Channel:
    """One caller's batched tokens (see the module docstring). `pending` is guarded by the
    front's lock: the core's report thread adds to it, `batches` takes it whole."""

    def __init__(
        self,
        key: str,
        loop: asyncio.AbstractEventLoop,
        interval_s: Callable[[], float],
        lock: threading.Lock,
    ) -> None:
        self.key = key
        self.loop = loop
        self.interval_s = interval_s  # read before each batch: it follows the replica's load
        self._lock = lock
        self.pending: dict[str, _Held] = {}  # request id -> its tokens not yet sent
        self.closed = False
        self._ready = asyncio.Event()  # set when pending turns non-empty, or on close
        self._sent_at = -float("inf")

    def wake(self) -> None:
        """From any thread: `batches` has something to look at."""
        self.loop.call_soon_threadsafe(self._ready.set)

    async def batches(self, idle_s: float) -> AsyncIterator[list[GenerateChunk]]:
        """Each batch once at least `interval_s()` has passed since the last; ends once closed,
        or after `idle_s` with nothing to send (the caller opens a new one when it needs it)."""
        while not self.closed:
            try:
                await asyncio.wait_for(self._ready.wait(), idle_s)
            except TimeoutError:
                with self._lock:
                    if not self.pending:
                        return
                continue
            self._ready.clear()
            wait = self._sent_at + self.interval_s() - self.loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            with self._lock:
                if self.closed:
                    return
                batch = [held.chunk() for held in self.pending.values()]
                self.pending.clear()
            if batch:
                self._sent_at = self.loop.time()
                yield batch


class AsyncEngine:
    """`core` runs the engine; this front owns the streams and channels. Every method but
    `start` and `shutdown` is called from an event loop (several loops may share one front);
    reports come in on the core's thread."""

    def __init__(
        self,
        core: EngineCore,
        stream_interval_s: float = STREAM_INTERVAL_S,
        max_chunks_per_s: float = 0.0,
    ) -> None:
        self.core = core
        self.stream_interval_s = stream_interval_s
        self.max_chunks_per_s = max_chunks_per_s  # 0: no cap
        # Streams that got tokens in the last step: written by the report thread, read by the
        # callers' loops (a plain int; a step-old figure is close enough to pace chunks by).
        self.flowing = 0
        self._streams: dict[str, _Stream] = {}
        self._channels: dict[str, Channel] = {}  # caller key -> its open channel
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        # guards _streams, _channels, _calls, _stopped and every channel's pending
        self._lock = threading.Lock()
        self._stopped: str | None = None  # why the core stopped, once it has
        self.num_aborted = 0  # live requests aborted (caller closed, or abandoned); the core's
        self.step_cpu_s = 0.0  # the engine loop's CPU time inside steps; the core's

    def start(self) -> None:
        self.core.start(self._on_report, self._on_stopped)

    def shutdown(self) -> None:
        """Stop the core; streams still live end with an error chunk, pending calls raise."""
        self.core.shutdown()

    @property
    def last_error(self) -> BaseException | None:
        """The engine's last step failure, or why its loop ended."""
        return self.core.last_error

    def chunk_interval(self) -> float:
        """How long a stream's chunks after its first wait for each other: `stream_interval_s`,
        or what keeps the streams that got tokens in the last step within `max_chunks_per_s`
        chunks a second in all (at most MAX_CHUNK_INTERVAL_S). More tokens a chunk, same
        tokens a second."""
        if self.max_chunks_per_s <= 0:
            return self.stream_interval_s
        paced = min(self.flowing / self.max_chunks_per_s, MAX_CHUNK_INTERVAL_S)
        return max(self.stream_interval_s, paced)

    @property
    def alive(self) -> bool:
        return self._stopped is None and self.core.alive

    async def generate(
        self, request: GenerateRequest, channel_key: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's tokens. Closing or cancelling the iteration aborts the request.
        While `channel_key`'s channel is open, the tokens between the first chunk and the last
        go there instead."""
        if not self.alive:
            yield _error_chunk(
                request.request_id, EngineError("the engine is not running", ErrorKind.UNAVAILABLE)
            )
            return
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), channel_key)
        with self._lock:
            stopped = self._stopped
            duplicate = request.request_id in self._streams
            if stopped is None and not duplicate:
                self._streams[request.request_id] = stream
        if stopped is not None:  # it stopped since `alive` was read
            error = EngineError(stopped, ErrorKind.UNAVAILABLE)
            yield _error_chunk(request.request_id, error)
            return
        if duplicate:
            yield _error_chunk(request.request_id, EngineError("duplicate request id"))
            return
        self.core.post(Add(request))
        finished = False
        loop = stream.loop
        sent_at = None  # when the last chunk went out; None before the first token
        following: GenerateChunk | None = None  # taken from the queue, not contiguous: next
        try:
            while not finished:
                if following is not None:
                    chunk, following = following, None
                else:
                    chunk = await stream.queue.get()
                if sent_at is not None and not chunk.finished:
                    # A stream's tokens are held until its interval has passed since the last
                    # chunk and go out as one: every chunk costs a streaming item here, in the
                    # caller and in the proxy, and this loop shares the GIL with the report
                    # thread (with the engine thread too, in-process).
                    wait = sent_at + self.chunk_interval() - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                # The first chunk goes out alone, at once: what a client times as its first
                # token is the engine's. Later ones take whatever else is already queued that
                # follows on (the tokens between may have gone on a channel meanwhile).
                while sent_at is not None and not chunk.finished and not stream.queue.empty():
                    after = stream.queue.get_nowait()
                    if after.error is None and after.start != chunk.start + len(chunk.token_ids):
                        following = after
                        break
                    chunk = _merge(chunk, after)
                finished = chunk.finished
                sent_at = loop.time()
                yield chunk
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self.core.post(Abort(request.request_id, None))

    def open_channel(self, key: str) -> Channel:
        """Open `key`'s channel (closing one it had open): its requests' tokens after their
        first chunk go there, those already running included. Close it with `close_channel`."""
        channel = Channel(key, asyncio.get_running_loop(), self.chunk_interval, self._lock)
        with self._lock:
            old = self._channels.get(key)
            self._channels[key] = channel
        if old is not None:
            self.close_channel(old)
        return channel

    def close_channel(self, channel: Channel) -> None:
        """What the channel holds goes back to its requests' streams, after whatever the report
        thread already queued for them (so in order), and their later tokens go there too.
        Idempotent."""
        with self._lock:
            if self._channels.get(channel.key) is channel:
                del self._channels[channel.key]
            channel.closed = True
            pending, channel.pending = channel.pending, {}
            batches = self._route_to_streams(held.chunk() for held in pending.values())
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)
        channel.wake()

    def drop_channel(self, key: str) -> None:
        """Close `key`'s channel, if open (its caller is dead)."""
        with self._lock:
            channel = self._channels.get(key)
        if channel is not None:
            self.close_channel(channel)

    def channel_keys(self) -> list[str]:
        with self._lock:
            return list(self._channels)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(engine, *args)` where the engine runs, between steps; returns its result or
        raises its exception (`EngineStopped` when the engine stops first). With the engine in
        a process of its own, `fn`, `args` and the result cross a pipe: they must pickle."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            stopped = self._stopped
            call_id = next(self._call_ids)
            if stopped is None:
                self._calls[call_id] = (loop, future)
        if stopped is not None:
            raise EngineStopped(stopped)
        try:
            self.core.post(Call(call_id, fn, args))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        try:
            return await future
        finally:
            with self._lock:  # answered, or its caller gave up waiting
                self._calls.pop(call_id, None)

    def abort(self, request_id: str, message: str) -> None:
        """Abort a request whose caller is gone without closing its stream (a dead ingress):
        between steps, the engine frees its KV blocks and slot hold, and its stream ends with an
        error chunk carrying `message` (503), so the generator serving it returns. Nothing to
        wait for; an unknown or finished request is ignored."""
        self.core.post(Abort(request_id, message))

    def hint(self, hints: list[tuple[str, float]]) -> None:
        """Adapters expected soon, (name, seconds until needed) each: the prefetcher starts on
        them between steps or while one runs. Nothing to wait for; unknown names are ignored."""
        self.core.post(Hints(list(hints)))

    def _on_report(self, report: StepReport) -> None:
        """On the core's thread: a report's answers, errors and outputs, in that order (as the
        loop produced them: the inbox between steps, then the step)."""
        self.num_aborted = report.num_aborted
        self.step_cpu_s = report.step_cpu_s
        for call_id, result, error in report.settled:
            with self._lock:
                waiting = self._calls.pop(call_id, None)
            if waiting is not None:
                loop, future = waiting
                loop.call_soon_threadsafe(_settle, future, result, error)
        for request_id, engine_error in report.errors:
            self._send(request_id, _error_chunk(request_id, engine_error))
        if report.stepped:
            self._deliver_all(report.outputs, report.tokens)

    def _on_stopped(self, why: str) -> None:
        """On the core's thread, once its loop has ended: nothing more will come, so every live
        stream ends with an UNAVAILABLE error chunk, every pending call raises and every
        channel closes."""
        with self._lock:
            self._stopped = why
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
            channels = list(self._channels.values())
        self.flowing = 0
        for channel in channels:  # their readers end now, not after their idle wait
            self.close_channel(channel)
        error = EngineError(why, ErrorKind.UNAVAILABLE)
        for request_id, stream in streams.items():
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, _error_chunk(request_id, error)
            )
        for loop, future in calls.values():
            loop.call_soon_threadsafe(_settle, future, None, EngineStopped(why))

    def _deliver_all(
        self,
        outputs: list[RequestOutput],
        tokens: Iterable[tuple[str, list[int], int]] = (),
    ) -> None:
        """A step's outputs (`StepReport`: `tokens` only carry tokens), handed to each caller
        loop in one callback: one wake-up of the loop per step, not one per request. A
        request's tokens after its first chunk go to its caller's channel when one is open
        (appended to what the channel holds of it: no chunk is made until the channel sends);
        its last chunk takes what the channel still holds of it and goes to its own stream."""
        woken: list[Channel] = []
        chunks: list[GenerateChunk] = []
        flowing = len(outputs)
        with self._lock:
            for request_id, token_ids, num_prompt_tokens in tokens:
                flowing += 1
                stream = self._streams.get(request_id)
                if stream is None:  # the caller went away; its abort is on the way
                    continue
                start = stream.emitted
                stream.emitted += len(token_ids)
                channel = self._channels.get(stream.channel_key) if stream.channel_key else None
                if channel is None or start == 0:
                    chunks.append(
                        GenerateChunk(
                            request_id, list(token_ids), None, num_prompt_tokens, start=start
                        )  # fmt: skip
                    )
                    continue
                held = channel.pending.get(request_id)
                if held is not None:
                    held.token_ids += token_ids
                    continue
                if not channel.pending:
                    woken.append(channel)
                channel.pending[request_id] = _Held(request_id, start, list(token_ids),
                                                    num_prompt_tokens)  # fmt: skip
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                chunk = _chunk(output, stream.emitted)
                first = stream.emitted == 0
                stream.emitted += len(chunk.token_ids)
                channel = self._channels.get(stream.channel_key) if stream.channel_key else None
                if channel is not None and not first:
                    held = channel.pending.pop(output.request_id, None)
                    if held is not None:
                        chunk = _merge(held.chunk(), chunk)
                    if not chunk.finished and chunk.error is None and chunk.metrics is None:
                        if not channel.pending:
                            woken.append(channel)
                        channel.pending[output.request_id] = _Held.of(chunk)
                        continue
                chunks.append(chunk)
            batches = self._route_to_streams(chunks)
        self.flowing = flowing
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)
        for channel in woken:
            channel.wake()

    def _route_to_streams(
        self, chunks: Iterable[GenerateChunk]
    ) -> dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerateChunk]]]:
        """Each chunk with its stream's queue, by the stream's loop; holds `_lock`."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerateChunk]]] = {}
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, chunk))
        return batches

    def _send(self, request_id: str, chunk: GenerateChunk) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:  # the caller went away; its abort is on the way
            return
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, chunk)


def _chunk(output: RequestOutput, start: int) -> GenerateChunk:
    error = None
    if output.error is not None:
        error = EngineError(output.error, output.error_kind or ErrorKind.INTERNAL)
    return GenerateChunk(
        output.request_id,
        list(output.new_token_ids),
        output.finish_reason,
        output.num_prompt_tokens,
        error,
        output.metrics,
        start,
    )


def _put_all(batch: list[tuple[asyncio.Queue, GenerateChunk]]) -> None:
    for q, chunk in batch:
        q.put_nowait(chunk)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _error_chunk(request_id: str, error: EngineError) -> GenerateChunk:
    return GenerateChunk(request_id, [], "error", 0, error)


def _merge(a: GenerateChunk, b: GenerateChunk) -> GenerateChunk:
    return GenerateChunk(
        a.request_id,
        a.token_ids + b.token_ids,
        b.finish_reason,
        b.num_prompt_tokens or a.num_prompt_tokens,
        b.error,
        b.metrics,
        a.start,
        a.replica_id,
    )
