"""A tiny OpenAI-compatible server for the load generator's tests, served by uvicorn on
127.0.0.1 in a thread: real sockets, real streaming, known timings.

Each request streams `max_tokens` tokens: the first after `first_token_delay_s`, the rest in
chunks of `tokens_per_chunk`, each chunk `token_delay_s` per token after the previous one. With
`capacity`, at most that many requests stream at once and the others queue for their turn, so
latency grows with the offered load.

`FakeTransport` answers the same completions without a server: on a virtual-time loop
(tests/loadgen/virtual_time.py) a client's timings then come out exactly as configured.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BASE = "fake-base"
ADAPTERS = ("ad-0", "ad-1", "ad-2")
BROKEN = "ad-broken"  # served but not listed; its stream fails after the first token


@dataclass(frozen=True)
class FakeConfig:
    first_token_delay_s: float = 0.03
    token_delay_s: float = 0.002
    tokens_per_chunk: int = 1
    usage_every_chunk: bool = False  # cumulative usage on every chunk, as vLLM can
    with_adapters_route: bool = True
    adapters: tuple[str, ...] = ADAPTERS
    capacity: int | None = None  # requests streamed at once; None: no limit


@dataclass
class FakeState:
    bodies: list[dict] = field(default_factory=list)
    requests_by_model: Counter = field(default_factory=Counter)


def make_app(config: FakeConfig, state: FakeState) -> FastAPI:
    app = FastAPI()
    turns = asyncio.Semaphore(config.capacity) if config.capacity else None

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": BASE, "object": "model", "parent": None}]
        cards += [{"id": a, "object": "model", "parent": BASE} for a in config.adapters]
        return {"object": "list", "data": cards}

    if config.with_adapters_route:

        @app.get("/v1/adapters")
        async def adapters() -> dict:
            rows = [
                {"name": a, "requests": state.requests_by_model[a], "resident": True}
                for a in config.adapters
            ]
            return {"loads_total": sum(state.requests_by_model.values()), "adapters": rows}

    async def generate(request: Request, chat: bool):
        status, answer = _completion(config, state, turns, await request.json(), chat)
        if status != 200:
            return JSONResponse(answer, status_code=status)
        return StreamingResponse(answer, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class FakeTransport(httpx.AsyncBaseTransport):
    """The fake's completions in the client's own event loop, for `OpenAIClient(transport=...)`
    (other routes are not served)."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.state = FakeState()
        self._turns = asyncio.Semaphore(self.config.capacity) if self.config.capacity else None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread())
        chat = request.url.path.endswith("/chat/completions")
        status, answer = _completion(self.config, self.state, self._turns, body, chat)
        if status != 200:
            return httpx.Response(status, json=answer)
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_EventStream(answer))


class _EventStream(httpx.AsyncByteStream):
    """A response body of events. Closed by a client that stops reading (at `[DONE]`), it ends
    the events, and with them the request's turn, as a server does when the connection goes."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for event in self._events:
            yield event.encode()

    async def aclose(self) -> None:
        await self._events.aclose()


def _completion(
    config: FakeConfig, state: FakeState, turns: asyncio.Semaphore | None, body: dict, chat: bool
) -> tuple[int, dict | AsyncIterator[str]]:
    """(404, the error body) for a model not served, else (200, the stream's events)."""
    state.bodies.append(body)
    if body["model"] not in {BASE, *config.adapters, BROKEN}:
        error = {"message": f"model {body['model']!r} not found", "type": "NotFoundError"}
        return 404, {"error": error}
    state.requests_by_model[body["model"]] += 1
    events = _events(config, body, chat)
    return 200, events if turns is None else _in_turn(turns, events)


async def _events(config: FakeConfig, body: dict, chat: bool) -> AsyncIterator[str]:
    total = body["max_tokens"]
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
    include_usage = (body.get("stream_options") or {}).get("include_usage", False)
    sent = 0
    await asyncio.sleep(config.first_token_delay_s)
    while sent < total:
        k = 1 if sent == 0 else min(config.tokens_per_chunk, total - sent)
        if sent:
            await asyncio.sleep(config.token_delay_s * k)
        sent += k
        text = "tok " * k
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        event: dict = {"object": "chunk", "choices": [choice]}
        if config.usage_every_chunk:
            event["usage"] = _usage(prompt_tokens, sent)
        yield f"data: {json.dumps(event)}\n\n"
        if body["model"] == BROKEN:
            error = {"message": "the engine failed", "type": "InternalServerError"}
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
    if include_usage:
        usage_event = {"object": "chunk", "choices": [], "usage": _usage(prompt_tokens, sent)}
        yield f"data: {json.dumps(usage_event)}\n\n"
    yield "data: [DONE]\n\n"


async def _in_turn(turns: asyncio.Semaphore, events: AsyncIterator[str]) -> AsyncIterator[str]:
    async with turns:
        async for event in events:
            yield event


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@contextmanager
def serve(config: FakeConfig | None = None) -> Iterator[tuple[str, FakeState]]:
    """Serve a fake on a free port of 127.0.0.1; yields its base URL and its state."""
    config = config or FakeConfig()
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(make_app(config, state), log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # it starts in milliseconds: only a hang guard
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the fake did not start"
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
