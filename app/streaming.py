"""From the engine's token chunks to an OpenAI answer: text, streamed as server-sent events or
gathered into one JSON body.

A `Generation` turns one request's chunks into text deltas (incremental detokenization, stop
strings); an `OutputShape` puts a delta into the route's response models (`CompletionOutput`,
`ChatOutput`); `sse_events` writes the streamed body. An error after streaming began is sent as
an SSE `{"error": ...}` event before `data: [DONE]`. Closing the engine stream aborts the request
there: when a stop string matches, when the client goes away, on any error.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from app.engine_client import ENGINE_FAILED
from app.metrics import GenerationTimer
from app.protocol import (
    INTERNAL_ERROR,
    APIError,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from app.tokenization import TextStream
from replicas.errors import ErrorKind
from replicas.protocol import GenerateChunk

logger = logging.getLogger("ray.serve")


# ---------------------------------------------------------------------------------------------
# The engine's stream


async def next_chunk(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    """The engine's next chunk. A stream that ends before its last chunk is an engine fault."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise APIError("the engine ended the stream before the request finished", 500) from None
    except APIError:
        raise
    except Exception as e:
        logger.exception("engine call failed")
        raise APIError(ENGINE_FAILED, 503) from e


def raise_engine_error(chunk: GenerateChunk) -> None:
    """An engine refusal as the client's error; an engine fault (INTERNAL) as a plain one, its
    message (which may carry internals) to the log."""
    error = chunk.error
    if error is not None and error.kind is not ErrorKind.INTERNAL:
        raise APIError.of(error.kind, error.message, param=error.param, code=error.code)
    if chunk.finish_reason == "error":
        if error is not None:
            logger.error("request %s failed in the engine: %s", chunk.request_id, error.message)
        raise APIError(INTERNAL_ERROR, 500)


async def close_stream(stream: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class Generation:
    """One generation in flight: iterating it yields `(text_delta, finish_reason)` until the
    request finishes; it ends early, finish_reason "stop", when a stop string matches. Engine
    errors raise `APIError`. `close()` aborts the request in the engine if it is still running."""

    def __init__(
        self,
        stream: AsyncIterator[GenerateChunk],
        first: GenerateChunk,
        text: TextStream,
        num_prompt_tokens: int,
        timer: GenerationTimer,
    ) -> None:
        self._stream = stream
        self._first: GenerateChunk | None = first  # already timed
        self._text = text
        self._timer = timer
        self.num_prompt_tokens = first.num_prompt_tokens or num_prompt_tokens
        self.finish_reason: str | None = None
        timer.admitted(self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return self._text.num_tokens

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens)

    async def __aiter__(self) -> AsyncIterator[tuple[str, str | None]]:
        while self.finish_reason is None:
            if self._first is not None:
                chunk, self._first = self._first, None
            else:
                chunk = await next_chunk(self._stream)
                self._timer.tokens(len(chunk.token_ids))
            raise_engine_error(chunk)
            delta = self._text.add(chunk.token_ids)
            if self._text.stopped:
                self.finish_reason = "stop"
                await self.close()  # the engine would go on to max_tokens otherwise
            elif chunk.finished:
                delta += self._text.finish()
                self.finish_reason = chunk.finish_reason
            if self.finish_reason is not None:
                self._timer.finished()
            if delta or self.finish_reason is not None:
                yield delta, self.finish_reason

    async def close(self) -> None:
        self._timer.close()
        await close_stream(self._stream)


# ---------------------------------------------------------------------------------------------
# Output shapes


class OutputShape:
    """How one route's answers look: its id, the streamed events (`chunk`, `usage_chunk`, and
    what the stream opens with) and the whole response. Subclasses name their response models
    and build their choices."""

    id_prefix: ClassVar[str]
    stream_model: ClassVar[type[BaseModel]]
    response_model: ClassVar[type[BaseModel]]

    def __init__(self, model: str) -> None:
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def _event(self, choices: list[Any], usage: UsageInfo | None = None) -> BaseModel:
        return self.stream_model(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def _stream_choice(self, text: str, finish_reason: str | None) -> BaseModel:
        raise NotImplementedError

    def _choice(self, text: str, finish_reason: str | None) -> BaseModel:
        raise NotImplementedError

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel:
        return self._event([self._stream_choice(text, finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._event([], usage)

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel:
        return self.response_model(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(text, finish_reason)],
            usage=usage,
        )


class CompletionOutput(OutputShape):
    id_prefix = "cmpl"
    stream_model = CompletionStreamResponse
    response_model = CompletionResponse

    def _stream_choice(self, text: str, finish_reason: str | None) -> BaseModel:
        return CompletionChoice(text=text, finish_reason=finish_reason)

    _choice = _stream_choice


class ChatOutput(OutputShape):
    id_prefix = "chatcmpl"
    stream_model = ChatCompletionStreamResponse
    response_model = ChatCompletionResponse

    def opening(self) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [self._event([ChatCompletionStreamChoice(delta=delta)])]

    def _stream_choice(self, text: str, finish_reason: str | None) -> BaseModel:
        delta = DeltaMessage(content=text or None)
        return ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)

    def _choice(self, text: str, finish_reason: str | None) -> BaseModel:
        message = AssistantMessage(content=text)
        return ChatCompletionChoice(message=message, finish_reason=finish_reason)


# ---------------------------------------------------------------------------------------------
# Server-sent events

DONE_EVENT = "data: [DONE]\n\n"


def _sse(payload: BaseModel, *, include_usage: bool) -> str:
    exclude = None if include_usage else {"usage"}
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def _error_event(error: APIError) -> str:
    return f"data: {json.dumps(error.to_response().model_dump())}\n\n"


async def sse_events(
    run: Generation, output: OutputShape, include_usage: bool
) -> AsyncIterator[str]:
    """The response body of a streamed generation, ending with `data: [DONE]`."""
    try:
        for opening in output.opening():
            yield _sse(opening, include_usage=include_usage)
        async for delta, finish_reason in run:
            yield _sse(output.chunk(delta, finish_reason), include_usage=include_usage)
        if include_usage:
            yield _sse(output.usage_chunk(run.usage), include_usage=True)
    except APIError as e:
        yield _error_event(e)
    except Exception:
        logger.exception("streaming request %s failed", output.request_id)
        yield _error_event(APIError(INTERNAL_ERROR, 500))
    finally:
        await run.close()
    yield DONE_EVENT


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always runs `on_close` when it ends, however it ends (done,
    client gone, send failed), so the engine request is never left running for nobody."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], Any], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from ray.exceptions import TaskCancelledError

        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            # Under Serve, `receive` raises this when the client disconnects: the normal end of
            # a stream nobody reads, as `http.disconnect` is in plain ASGI.
            pass
        finally:
            # A body left suspended at a `yield` (the client went away mid-send) is closed here
            # rather than whenever it is garbage-collected.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._on_close()
