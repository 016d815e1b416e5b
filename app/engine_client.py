"""The ingress's client of the engine deployment: a request's chunks, from its own stream and
from this ingress's channel to the engine replica serving it.

Each request is one streaming call (`EngineDeployment.generate`), routed by the adapter-affinity
router; it stays open until the request ends, so Serve's queue lengths, `max_ongoing_requests`,
cancellation on a client's disconnect and the engines' leases work per request as before. What
it carries is its first chunk (at once: the client's first token) and its last. The tokens
between travel on a channel: one streaming call per engine replica this ingress uses
(`EngineDeployment.channel`, pinned to that replica by the router), which carries every one of
this ingress's requests there as one batch an interval. A Ray streaming item costs about as
much CPU in the engine, here and in between whether it holds one request's tokens or a hundred
requests' (docs/perf/serving.md), and the engine replica's process shares its GIL with the step
loop.

A request's first chunk names its replica; the first such name opens the channel, and the
engine moves that ingress's running requests onto it. Chunks say where their tokens start, so a
request's chunks are put back in order whichever way each came. If a channel fails, the engine
sends what it held on the requests' own streams; a request missing tokens a failed channel had
already sent ends with an error (503), as a failed request stream does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

from app.fleet import ServeFleetClient
from replicas import hop_log
from replicas.errors import ErrorKind
from replicas.protocol import EngineError, GenerateChunk, GenerateRequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

    from replicas.adapter_ledger import LedgerStore

logger = logging.getLogger("ray.serve")

ENGINE_FAILED = "the engine replica serving this request failed or is unavailable; retry"
ENGINE_BUSY = "every engine replica's queue is full; retry later"

CHANNEL_RETRY_S = 1.0  # after a channel failed to open, how long before it is tried again
# A request whose last chunk came while tokens before it are still on their way on a channel:
# how long to wait for them once the channel is gone before giving the request up.
GAP_WAIT_S = 5.0

_CHANNEL_LOST = object()  # an inbox item: the channel of this request's replica ended


class ServeEngineClient(ServeFleetClient):
    """`EngineClient` over a handle to the engine deployment (see the module docstring). The
    adapter name is the request's multiplexed model id, which the router uses to place it."""

    def __init__(
        self,
        handle: DeploymentHandle,
        *,
        ledger: LedgerStore | None = None,
        channels: bool = True,
    ) -> None:
        super().__init__(handle, ledger=ledger)
        # Channels need this ingress's id (the engine keys them by caller) and a live loop.
        self._channels_on = channels and self.caller_id is not None
        self._inboxes: dict[str, asyncio.Queue] = {}  # request id -> its chunks from channels
        self._replica_of: dict[str, str] = {}  # request id -> its engine replica
        self._channels: dict[str, asyncio.Task] = {}  # replica id -> the task reading it
        self._retry_at: dict[str, float] = {}  # replica id -> when a failed open may retry

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        rid = request.request_id
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[rid] = inbox
        hop_log.stamp("engine_call")
        # Under this ingress's id: the engine aborts the request if this process dies.
        response = self._handle.options(
            stream=True, multiplexed_model_id=request.adapter or ""
        ).generate.remote(request, self.caller_id)
        pump = asyncio.create_task(self._pump(rid, response, inbox))
        order = _InOrder()
        finished = False
        try:
            while not finished:
                item = await order.next(inbox, lambda: self._replica_channel_open(rid))
                if item is None:  # the request's stream ended short of its last token
                    logger.warning("request %s: tokens lost with a failed channel", rid)
                    item = _failed(rid, ENGINE_FAILED)
                finished = item.finished
                yield item
        finally:
            self._inboxes.pop(rid, None)
            self._replica_of.pop(rid, None)
            if not pump.done():
                pump.cancel()
            if not finished:
                response.cancel()  # the replica's generator is cancelled, which aborts it

    async def _pump(self, rid: str, response: Any, inbox: asyncio.Queue) -> None:
        """The request's own stream into its inbox; a failed call becomes an error chunk."""
        import grpc
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import (
            BackPressureError,
            DeploymentUnavailableError,
            ReplicaUnavailableError,
            RequestCancelledError,
        )

        try:
            async for chunk in response:
                if chunk.replica_id is not None:
                    self._replica_of[rid] = chunk.replica_id
                    self._offer(chunk.replica_id)
                inbox.put_nowait(chunk)
                if chunk.finished:
                    return
            inbox.put_nowait(_failed(rid, ENGINE_FAILED))  # ended without a last chunk
        except (
            BackPressureError,
            DeploymentUnavailableError,
            ReplicaUnavailableError,
            RayActorError,
        ) as e:
            # The exception names the replica's actor, process and class: the log's, not the
            # client's.
            logger.warning("request %s: engine replica failed: %r", rid, e)
            message = ENGINE_BUSY if isinstance(e, BackPressureError) else ENGINE_FAILED
            inbox.put_nowait(_failed(rid, message))
        except grpc.aio.AioRpcError as e:
            # Over gRPC (`Ingress`), a call the replica ended other than by its own reply.
            logger.warning("request %s: engine call ended: %s %s", rid, e.code(), e.details())
            inbox.put_nowait(_failed(rid, ENGINE_FAILED))
        except RequestCancelledError:
            # Serve cancelled the call: its HTTP client went away (Serve cancels the calls a
            # request made when it disconnects). Nobody reads the answer.
            inbox.put_nowait(_failed(rid, ENGINE_FAILED))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("request %s: the engine call failed", rid)
            inbox.put_nowait(_failed(rid, ENGINE_FAILED))

    def _replica_channel_open(self, rid: str) -> bool:
        replica = self._replica_of.get(rid)
        return replica is not None and replica in self._channels

    def _offer(self, replica_id: str) -> None:
        """A request runs on `replica_id`: open this ingress's channel there, unless open (or
        opening), or unless it failed to open within the last `CHANNEL_RETRY_S`."""
        if not self._channels_on or replica_id in self._channels:
            return
        if time.monotonic() < self._retry_at.get(replica_id, 0.0):
            return
        self._channels[replica_id] = asyncio.create_task(self._read_channel(replica_id))

    async def _read_channel(self, replica_id: str) -> None:
        response = cast(  # Ray types `.remote()` for both modes; streaming, it is a generator
            "DeploymentResponseGenerator[list[GenerateChunk]]",
            self._handle.options(stream=True).channel.remote(self.caller_id, replica_id),
        )
        opened = False
        try:
            # However long the open takes (a busy replica): the engine moves the requests' tokens
            # onto the channel as it opens, so a channel given up then would lose what it sent.
            # Until it opens, the requests' own streams carry their tokens.
            await response.__anext__()
            opened = True
            async for batch in response:
                for chunk in batch:
                    inbox = self._inboxes.get(chunk.request_id)
                    if inbox is not None:  # else the request is over here (its client left)
                        inbox.put_nowait(chunk)
        except StopAsyncIteration:
            pass  # reached another replica (pinning lost a race) and ended unopened
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.info("channel to engine replica %s ended: %r", replica_id, e)
        finally:
            response.cancel()
            del self._channels[replica_id]
            if not opened:
                self._retry_at[replica_id] = time.monotonic() + CHANNEL_RETRY_S
            # Requests waiting on tokens this channel sent look again (`_InOrder`).
            for rid, replica in list(self._replica_of.items()):
                inbox = self._inboxes.get(rid)
                if replica == replica_id and inbox is not None:
                    inbox.put_nowait(_CHANNEL_LOST)

    async def close(self) -> None:
        """End this ingress's channels (its requests' own streams carry the rest)."""
        for task in list(self._channels.values()):
            task.cancel()

    async def info(self) -> dict[str, Any]:
        return await self._handle.info.remote()


class _InOrder:
    """A request's chunks, from its stream and its channel, handed on in token order. A chunk
    with an error ends the request at once."""

    def __init__(self) -> None:
        self.next_start = 0
        self._held: dict[int, GenerateChunk] = {}  # start -> chunk that came early

    async def next(
        self, inbox: asyncio.Queue, channel_open: Callable[[], bool]
    ) -> GenerateChunk | None:
        """The next chunk in order; None once the tokens before a held chunk cannot come (no
        channel to the request's replica is open, and `GAP_WAIT_S` passed)."""
        deadline = None
        while True:
            chunk = self._take()
            if chunk is not None:
                return chunk
            if not self._held or channel_open():
                deadline = None
            elif deadline is None:
                deadline = time.monotonic() + GAP_WAIT_S
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = await asyncio.wait_for(inbox.get(), timeout)
            except TimeoutError:
                return None
            if item is _CHANNEL_LOST:  # look at the channel again
                continue
            if item.error is not None:
                return item
            if item.start < self.next_start:
                continue  # nothing new (a chunk sent twice would be a bug upstream)
            # Starts are distinct: every chunk but a last or failed one carries tokens.
            self._held[item.start] = item

    def _take(self) -> GenerateChunk | None:
        chunk = self._held.pop(self.next_start, None)
        if chunk is not None:
            self.next_start += len(chunk.token_ids)
        return chunk


def _failed(rid: str, message: str) -> GenerateChunk:
    return GenerateChunk(
        rid,
        finish_reason="error",
        error=EngineError(message, ErrorKind.UNAVAILABLE),
    )
