"""The load spread over processes: `ShardedClient` sends each request from one of several
worker processes, each with its own `OpenAIClient` on its own event loop.

One process reading server-sent events tops out near one core: an httpx stream costs about
50-100 µs of the client's CPU a token at the chunk sizes the app sends, so a single client
measures itself, not the server, past about 10-20k tokens a second. Here the arrivals are still
scheduled in this process (`loadgen.runner.run_load` calls `send` at each request's time); the
request goes to the worker with the fewest in flight, which streams it and sends back its
`RequestRecord`.

Times stay comparable: the workers time with `time.perf_counter`, which on Linux reads the
system-wide monotonic clock, so `t0` from this process means the same instant in a worker.
This process only passes messages, on a writer and a reader thread per worker: its event loop
never blocks on a pipe, so a worker sending records back never waits on a loop that is itself
waiting to hand that worker more requests.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing
import queue
import threading
from typing import Any

from loadgen.client import OpenAIClient
from loadgen.records import RequestRecord
from workloads.requests import RequestSpec

READY_TIMEOUT_S = 60.0  # a worker's start: a fresh interpreter importing httpx
STOP_TIMEOUT_S = 10.0


class WorkerLost(RuntimeError):
    """A load generator worker process ended with requests in flight (a harness failure, not
    the server's)."""


class _Shard:
    """One worker process and this side's two threads on its pipe."""

    def __init__(self, index: int, ctx: Any, base_url: str, options: dict[str, Any]) -> None:
        self.index = index
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker, args=(child, base_url, options), name=f"loadgen-{index}", daemon=True
        )
        self.process.start()
        child.close()
        self.outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.in_flight = 0
        self.lost = False  # its reader saw the pipe end (set on the event loop's thread)

    def start_threads(self, deliver: Any) -> None:
        self.writer = threading.Thread(target=self._write, name=f"loadgen-{self.index}-out")
        self.reader = threading.Thread(
            target=self._read, args=(deliver,), name=f"loadgen-{self.index}-in"
        )
        self.writer.start()
        self.reader.start()

    def _write(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, EOFError):  # the worker is gone: the reader reports it
                return

    def _read(self, deliver: Any) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (OSError, EOFError):
                deliver(self, None)
                return
            deliver(self, message)


class ShardedClient:
    """`OpenAIClient`'s `send` over `shards` worker processes (see the module docstring);
    `adapter_stats` and `list_models` are asked from this process. Use as `async with`."""

    def __init__(self, base_url: str, shards: int, **client_options: Any) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        self.base_url = base_url
        self.num_shards = shards
        self.options = client_options
        self._local = OpenAIClient(base_url, **client_options)
        self._shards: list[_Shard] = []
        self._pending: dict[int, tuple[_Shard, asyncio.Future[RequestRecord]]] = {}
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> ShardedClient:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # no forked copy of this process's threads
        try:
            for i in range(self.num_shards):
                shard = _Shard(i, ctx, self.base_url, self.options)
                self._ready[i] = self._loop.create_future()
                self._shards.append(shard)
                shard.start_threads(self._from_thread)
            await asyncio.wait_for(asyncio.gather(*self._ready.values()), READY_TIMEOUT_S)
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    def worker_pids(self) -> list[int]:
        return [s.process.pid for s in self._shards if s.process.pid is not None]

    async def adapter_stats(self) -> dict[str, Any] | None:
        return await self._local.adapter_stats()

    async def list_models(self) -> list[dict[str, Any]]:
        return await self._local.list_models()

    async def send(self, spec: RequestSpec, scheduled_s: float, t0: float) -> RequestRecord:
        """As `OpenAIClient.send`, from the worker with the fewest requests in flight.
        Cancelling it cancels the request in its worker (its stream is closed there)."""
        assert self._loop is not None, "use ShardedClient as `async with`"
        shard = min(self._shards, key=lambda s: s.in_flight)
        if shard.lost:
            raise WorkerLost(f"load generator worker {shard.index} is not running")
        token = next(self._tokens)
        future: asyncio.Future[RequestRecord] = self._loop.create_future()
        self._pending[token] = (shard, future)
        shard.in_flight += 1
        shard.outbox.put(("send", token, spec, scheduled_s, t0))
        try:
            return await future
        except asyncio.CancelledError:
            shard.outbox.put(("cancel", token))
            raise
        finally:
            self._pending.pop(token, None)
            shard.in_flight -= 1

    def _from_thread(self, shard: _Shard, message: tuple | None) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, shard, message)
        except RuntimeError:  # the loop closed: nobody waits any more
            pass

    def _deliver(self, shard: _Shard, message: tuple | None) -> None:
        if message is None:  # the worker ended
            shard.lost = True
            lost = WorkerLost(f"load generator worker {shard.index} ended")
            ready = self._ready.get(shard.index)
            if ready is not None and not ready.done():
                ready.set_exception(lost)
            for s, future in list(self._pending.values()):
                if s is shard and not future.done():
                    future.set_exception(lost)
            return
        if message[0] == "ready":
            self._ready[shard.index].set_result(None)
            return
        kind, token, value = message
        entry = self._pending.get(token)
        if entry is None or entry[1].done():
            return
        if kind == "record":
            entry[1].set_result(value)
        else:
            entry[1].set_exception(RuntimeError(f"load generator worker {shard.index}: {value}"))

    async def _stop(self) -> None:
        for shard in self._shards:
            shard.outbox.put(("stop",))
            shard.outbox.put(None)
        for shard in self._shards:
            await asyncio.to_thread(shard.process.join, STOP_TIMEOUT_S)
            if shard.process.is_alive():
                shard.process.kill()
                await asyncio.to_thread(shard.process.join, STOP_TIMEOUT_S)
            shard.conn.close()  # the reader thread ends on it
        for shard in self._shards:
            for thread in (getattr(shard, "writer", None), getattr(shard, "reader", None)):
                if thread is not None:
                    await asyncio.to_thread(thread.join, STOP_TIMEOUT_S)
        self._shards = []
        await self._local.__aexit__(None, None, None)


def _worker(conn: Any, base_url: str, options: dict[str, Any]) -> None:
    """A worker process: requests in from `conn`, records out, until told to stop."""
    asyncio.run(_serve(conn, base_url, options))


async def _serve(conn: Any, base_url: str, options: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    tasks: dict[int, asyncio.Task[None]] = {}
    stopped = asyncio.Event()
    async with OpenAIClient(base_url, **options) as client:

        async def one(token: int, spec: RequestSpec, scheduled_s: float, t0: float) -> None:
            try:
                record = await client.send(spec, scheduled_s, t0)
            except Exception as e:  # a bug in the client: the caller's send raises it
                conn.send(("error", token, f"{type(e).__name__}: {e}"))
                return
            conn.send(("record", token, record))  # the other side reads on a thread of its own

        def forget(token: int, _: asyncio.Task[None]) -> None:
            tasks.pop(token, None)

        def readable() -> None:
            while not stopped.is_set() and conn.poll():
                try:
                    message = conn.recv()
                except (OSError, EOFError):
                    stopped.set()
                    return
                if message[0] == "send":
                    token = message[1]
                    tasks[token] = loop.create_task(one(*message[1:]))
                    tasks[token].add_done_callback(functools.partial(forget, token))
                elif message[0] == "cancel":
                    running = tasks.get(message[1])
                    if running is not None:
                        running.cancel()
                else:
                    stopped.set()

        loop.add_reader(conn.fileno(), readable)
        conn.send(("ready",))
        await stopped.wait()
        loop.remove_reader(conn.fileno())
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    conn.close()
