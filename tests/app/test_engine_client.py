"""The ingress's engine client (app/engine_client.py) over a fake handle: a request's chunks
from its own stream and from the channel come out in token order, a channel that fails with
tokens in flight fails only the requests missing them, and a channel that cannot open costs
nothing."""

from __future__ import annotations

import asyncio
import logging

import pytest

import app.engine_client as engine_client
from app.engine_client import ServeEngineClient
from replicas.errors import ErrorKind
from replicas.protocol import GenerateChunk, GenerateRequest
from replicas.request import SamplingParams

TOKENS = list(range(100, 110))
SLOW_OPEN_S = 0.3


class Streamed:
    def __init__(self, gen) -> None:
        self._gen = gen
        self.cancelled = False

    def __aiter__(self):
        return self._gen

    async def __anext__(self):
        return await self._gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class FakeHandle:
    """An engine deployment of one replica, "e1": a request's stream sends its first token, then
    waits for `release` and sends the rest as its last chunk unless `channel_tokens` of them went
    on the channel first (`channel_mode`: "ok", "fail" after opening, or "refuse")."""

    def __init__(self, channel_mode: str = "ok", channel_tokens: int = 6) -> None:
        self.channel_mode = channel_mode
        self.channel_tokens = channel_tokens
        self.release = asyncio.Event()
        self.channel_open = asyncio.Event()
        self.channel_calls = 0
        self.responses: list[Streamed] = []
        self.generate = Method(self._generate)
        self.channel = Method(self._channel)

    def options(self, **_):
        return self

    def _generate(self, request: GenerateRequest, caller):
        assert caller == "ingress-1"
        response = Streamed(self._request(request))
        self.responses.append(response)
        return response

    async def _request(self, request: GenerateRequest):
        rid = request.request_id
        yield GenerateChunk(rid, TOKENS[:1], None, 3, replica_id="e1")
        await self.release.wait()
        start = 1 + (self.channel_tokens if self.channel_mode != "refuse" else 0)
        yield GenerateChunk(rid, TOKENS[start:], "length", 3, start=start)

    def _channel(self, caller, replica_id):
        assert (caller, replica_id) == ("ingress-1", "e1")
        self.channel_calls += 1
        return Streamed(self._batches())

    async def _batches(self):
        if self.channel_mode == "refuse":
            return
        if self.channel_mode == "slow":  # a busy replica: the open's answer is late
            await asyncio.sleep(SLOW_OPEN_S)
        yield []
        self.channel_open.set()
        # The middle tokens come after the request's last chunk: out of order on purpose.
        self.release.set()
        await asyncio.sleep(0.05)
        if self.channel_mode == "fail":
            raise RuntimeError("the channel broke")
        yield [GenerateChunk("r1", TOKENS[1 : 1 + self.channel_tokens], start=1)]
        await asyncio.Event().wait()  # open until cancelled


@pytest.fixture
def client_for(monkeypatch):
    monkeypatch.setattr("app.fleet.caller_id", lambda: "ingress-1")
    return ServeEngineClient


def request() -> GenerateRequest:
    return GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=len(TOKENS)))


async def test_chunks_from_the_stream_and_the_channel_come_out_in_order(client_for):
    handle = FakeHandle("ok")
    client = client_for(handle)
    chunks = [c async for c in client.generate(request())]
    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert [c.start for c in chunks] == [0, 1, 7]
    assert chunks[-1].finish_reason == "length" and not any(c.finished for c in chunks[:-1])
    assert handle.channel_calls == 1
    await client.close()


async def test_a_channel_that_fails_with_tokens_in_flight_fails_the_request(
    client_for, monkeypatch
):
    monkeypatch.setattr(engine_client, "GAP_WAIT_S", 0.05)
    client = client_for(FakeHandle("fail"))
    chunks = [c async for c in client.generate(request())]
    assert chunks[0].token_ids == TOKENS[:1]
    assert chunks[-1].finish_reason == "error" and chunks[-1].error.kind is ErrorKind.UNAVAILABLE
    assert "engine replica" in chunks[-1].error.message
    assert [t for c in chunks for t in c.token_ids] == TOKENS[:1]  # nothing out of order


async def test_a_channel_slow_to_open_is_waited_for_and_loses_nothing(client_for, monkeypatch):
    """Under load a replica answers a channel's open late, and then carries the requests'
    tokens on it at once. Giving the channel up on a timeout (5 s, once) lost the tokens it
    had sent by then: 95 of 2,048 requests of a timed 4-replica run on 2 cores."""
    monkeypatch.setattr(engine_client, "GAP_WAIT_S", 0.05)
    handle = FakeHandle("slow")
    client = client_for(handle)
    chunks = await asyncio.wait_for(collect(client.generate(request())), 10)
    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert chunks[-1].finish_reason == "length" and handle.channel_calls == 1
    await client.close()


async def collect(stream) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]


async def test_a_channel_that_does_not_open_is_tried_again_later_and_costs_nothing(client_for):
    handle = FakeHandle("refuse")
    client = client_for(handle)
    handle.release.set()
    first = client.generate(request())
    assert (await first.__anext__()).token_ids == TOKENS[:1]
    for _ in range(20):  # the channel's call ends unopened
        await asyncio.sleep(0.01)
        if not client._channels:
            break
    assert not client._channels
    rest = [c async for c in first]
    assert [t for c in rest for t in c.token_ids] == TOKENS[1:]
    # The next request's offer does not retry at once.
    again = [c async for c in client.generate(GenerateRequest("r2", [1], request().sampling))]
    assert again[-1].finished and handle.channel_calls == 1


async def test_closing_a_request_cancels_its_call_and_forgets_it(client_for):
    handle = FakeHandle("ok")
    client = client_for(handle)
    stream = client.generate(request())
    await stream.__anext__()
    await stream.aclose()
    assert handle.responses[0].cancelled
    assert not client._inboxes and not client._replica_of
    await client.close()


class FailingHandle(FakeHandle):
    """A request's stream that fails with `error` before its first chunk."""

    def __init__(self, error: BaseException) -> None:
        super().__init__("ok")
        self.error = error

    async def _request(self, request: GenerateRequest):
        raise self.error
        yield  # a generator


def _call_ended() -> BaseException:
    import grpc

    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "stream reset"
    )


def _cancelled_by_serve() -> BaseException:
    from ray.serve.exceptions import RequestCancelledError

    return RequestCancelledError("r1")


@pytest.mark.parametrize(
    "make_error, logged",
    [(_call_ended, ["WARNING"]), (_cancelled_by_serve, [])],
    ids=["grpc-call-ended", "serve-cancelled"],
)
async def test_a_request_stream_ended_by_its_transport_fails_the_request_quietly(
    client_for, caplog, make_error, logged
):
    """Over gRPC a call can end with the transport's own error (the replica's process gone) or
    with Serve's cancellation (the HTTP client left): the request ends with the engine-failed
    error, and the log has a warning at most, no traceback."""
    client = client_for(FailingHandle(make_error()))
    serve_logger = logging.getLogger("ray.serve")  # Ray's; it does not propagate
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="ray.serve"):
            chunks = [c async for c in client.generate(request())]
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert len(chunks) == 1 and chunks[0].finish_reason == "error"
    assert chunks[0].error is not None and chunks[0].error.message == engine_client.ENGINE_FAILED
    assert chunks[0].error.kind is ErrorKind.UNAVAILABLE
    levels = [r.levelname for r in caplog.records]
    assert "ERROR" not in levels and all(r.exc_info is None for r in caplog.records)
    assert levels == logged
    await client.close()
