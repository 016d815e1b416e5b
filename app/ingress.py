"""The HTTP front: OpenAI-compatible routes over an engine client.

`make_api(engine, tokenizer, settings, metrics=...)` builds the FastAPI app from its
collaborators, so tests run it with a fake engine, a fake metrics backend and no Ray. `Ingress`
is the Serve deployment: it receives the engine deployment's handle, and at replica start-up
(`__serve_build_asgi_app__`) prepares the model files, loads the tokenizer and builds the app.

Each generation: resolve `model` to the base or an adapter, tokenize (chat template for chat),
check the context length, send one `GenerateRequest` to the engine, and turn its token chunks
into text. The first chunk is awaited before answering, so a request the engine refuses gets a
proper status; an error after streaming began is sent as an SSE `{"error": ...}` event. Closing
the engine stream aborts the request there: when a stop string matches, when the client goes
away, on any error.

Before a route runs, `app/guards.py` checks the API key (when one is set) and bounds the body.
Tokenization and chat templates run on worker threads (`TokenizerPool`), never on the event loop.
Every failure answers in OpenAI's error body, JSON, with the status the OpenAPI schema declares
for the route; a failure of ours (an engine replica died, a bug) says so without internals, which
go to the log.

Adapter management (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/v1/adapters`) is in
`app/management.py`; the metrics in `app/metrics.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.adapters import AdapterError, AdapterRegistry
from app.engine_client import ENGINE_FAILED, ServeEngineClient
from app.fleet import FleetClient
from app.guards import ApiKeyGuard, BodyLimit, default_body_limit
from app.hub import HubAdapters
from app.management import AdapterAdmin
from app.metrics import GenerationTimer, IngressMetrics, RequestCounter
from app.protocol import (
    AdapterList,
    APIError,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    UnloadLoraAdapterRequest,
    UsageInfo,
)
from app.tokenization import ChatTemplateError, TextStream, TokenizerPool, load_tokenizer
from replicas.adapters.hub import HubAccess
from replicas.protocol import GenerateChunk, GenerateRequest
from replicas.request import SamplingParams

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ray.serve")


# ---------------------------------------------------------------------------------------------
# The engine, as the routes see it


class EngineClient(FleetClient, Protocol):
    """What the routes need from the engine fleet: generation, and the control plane of
    `FleetClient`.

    `generate` yields the request's chunks (the last one has `finish_reason`; a refusal is one
    chunk with `error`). Closing the iterator before the last chunk (`aclose`, or cancelling the
    task iterating it) must abort the request in the engine. `info` returns
    `{"max_model_len": int, "eos_token_ids": list[int], "vocab_size": int}`.
    """

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...

    async def info(self) -> dict[str, Any]: ...


INTERNAL_ERROR = "the server failed to complete this request (an internal error, logged)"


@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------------
# Settings and the app


@dataclass(frozen=True)
class ApiSettings:
    """What the routes need to know besides the engine and the tokenizer."""

    served_model_name: str
    model_root: str  # where the base model comes from (the model folder or hub id)
    adapters: Mapping[str, str] = field(default_factory=dict)  # validated at build time
    adapter_root: str | None = None
    max_lora_rank: int = 16
    runtime_adapter_dirs: tuple[str, ...] = ()  # empty: /v1/load_lora_adapter is off (403)
    hub_adapter_repos: tuple[str, ...] = ()  # empty: no hub adapter fetched at run time
    hub_timeout_s: float = 30.0
    max_hub_adapter_bytes: int = 2 << 30
    api_key: str | None = field(default=None, repr=False)  # None: /v1/ is open
    max_model_len: int | None = None  # as configured, or the model's; sizes the body limit
    max_request_body_bytes: int | None = None  # None: from max_model_len

    @property
    def body_limit(self) -> int:
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return default_body_limit(self.max_model_len)


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each an OpenAI error body."""
    meaning = {
        400: "A malformed body or a value the server cannot honour",
        401: "No valid API key (when the server requires one)",
        403: "Turned off on this server",
        404: "Unknown model or adapter",
        413: "The body is larger than the server accepts",
        500: "Internal error (details in the server log)",
        503: "No engine replica can take the request now",
    }
    return {s: {"model": ErrorResponse, "description": meaning[s]} for s in statuses}


# What every /v1/ route may answer besides its own errors.
_COMMON_ERRORS = (400, 401, 413, 500)
_GENERATION_ERRORS = _errors(*_COMMON_ERRORS, 404, 503)
_STREAMED = {"text/event-stream": {"schema": {"type": "string"}}}
_PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def make_api(
    engine: EngineClient,
    tokenizer: PreTrainedTokenizerBase,
    settings: ApiSettings,
    *,
    metrics: IngressMetrics | None = None,
) -> FastAPI:
    """The OpenAI-compatible app: /v1/completions, /v1/chat/completions, /v1/models, /health,
    and adapter management. `metrics` defaults to the Ray Serve metrics. The tokenizer's worker
    threads stop when the app shuts down."""
    metrics = metrics if metrics is not None else IngressMetrics()
    service = OpenAIService(engine, TokenizerPool(tokenizer), settings, metrics)
    admin = service.admin

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.tokenization.shutdown()

    api = FastAPI(
        title="lorafleet", summary="One base model, many LoRA adapters.", lifespan=lifespan
    )

    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Its headers stay: a 405 lists the allowed methods in `Allow`.
        return error_response(APIError(str(exc.detail), exc.status_code), headers=exc.headers)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception after this answer; the client gets no internals.
        return error_response(APIError(INTERNAL_ERROR, 500))

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models", responses=_errors(401, 500))
    async def models() -> ModelList:
        return await service.models()

    @api.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": _STREAMED}, **_GENERATION_ERRORS},
    )
    async def completions(body: CompletionRequest) -> Response:
        return await service.completions(body)

    @api.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": _STREAMED}, **_GENERATION_ERRORS},
    )
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await service.chat_completions(body)

    @api.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses={200: {"content": _PLAIN_TEXT}, **_errors(*_COMMON_ERRORS, 403, 404, 503)},
    )
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await admin.load(body))

    @api.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses={200: {"content": _PLAIN_TEXT}, **_errors(*_COMMON_ERRORS, 404, 503)},
    )
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await admin.unload(body))

    @api.get("/v1/adapters", responses=_errors(401, 500))
    async def adapters() -> AdapterList:
        return await admin.listing()

    api.openapi = functools.partial(_openapi, api)  # type: ignore[method-assign]
    routes = [
        route.path
        for route in api.routes
        if isinstance(route, Route) and route.path.startswith(("/v1/", "/health"))
    ]
    # The last added runs first: count every request, then the key, then the body's size.
    api.add_middleware(BodyLimit, max_bytes=settings.body_limit)
    if settings.api_key is not None:
        api.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    api.add_middleware(RequestCounter, metrics=metrics, routes=routes)
    return api


def _openapi(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with every error answered as JSON in OpenAI's body (FastAPI would give
    a plain-text route's errors its media type) and without FastAPI's 422 (a malformed body is
    OpenAI's 400 here)."""
    if api.openapi_schema is None:
        schema = get_openapi(
            title=api.title, version=api.version, summary=api.summary, routes=api.routes
        )
        error_body = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                responses.pop("422", None)
                for status, response in responses.items():
                    if status.startswith(("4", "5")):
                        response["content"] = {"application/json": error_body}
        components = schema.get("components", {}).get("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        api.openapi_schema = schema
    return api.openapi_schema


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error.to_response().model_dump(),
        status_code=error.status,
        headers={**error.headers, **(headers or {})},
    )


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400: one message naming each bad field."""
    messages: list[str] = []
    params: list[str] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            messages.append(f"the request body is not valid JSON: {detail}".rstrip(": "))
            continue
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        messages.append(f"{loc or 'request body'}: {message}")
        if loc:
            params.append(loc)
    return APIError(
        "; ".join(messages) or "invalid request", 400, param=params[0] if params else None
    )


class OpenAIService:
    """The routes' logic, apart from FastAPI wiring."""

    def __init__(
        self,
        engine: EngineClient,
        tokenization: TokenizerPool,
        settings: ApiSettings,
        metrics: IngressMetrics,
    ) -> None:
        self.engine = engine
        self.tokenization = tokenization
        self.tokenizer = tokenization.tokenizer
        self.settings = settings
        self.metrics = metrics
        self.registry = AdapterRegistry(
            settings.served_model_name,
            settings.adapters,
            adapter_root=settings.adapter_root,
            max_lora_rank=settings.max_lora_rank,
            fleet_view=engine.served_adapters,
            serve_from_hub=self._serve_from_hub,
        )
        hub = HubAdapters(
            settings.hub_adapter_repos,
            HubAccess.from_env(settings.hub_timeout_s, settings.max_hub_adapter_bytes),
            settings.max_lora_rank,
        )
        self.admin = AdapterAdmin(
            engine, self.registry, runtime_adapter_dirs=settings.runtime_adapter_dirs, hub=hub
        )
        self._info: EngineInfo | None = None
        self._info_lock = asyncio.Lock()

    # -- models ------------------------------------------------------------------------------

    async def models(self) -> ModelList:
        """The base model and every adapter served by name (adapter_root folders once used),
        as the engine fleet knows them."""
        await self.registry.refresh()
        base = self.settings.served_model_name
        max_len = self._info.max_model_len if self._info is not None else None
        cards = [ModelCard(id=base, root=self.settings.model_root, max_model_len=max_len)]
        for name, path in sorted(self.registry.adapters.items()):
            cards.append(ModelCard(id=name, root=str(path), parent=base, max_model_len=max_len))
        return ModelList(data=cards)

    async def _serve_from_hub(self, name: str) -> bool:
        return await self.admin.serve_from_hub(name)

    async def resolve_adapter(self, model: str) -> str | None:
        try:
            return await self.registry.resolve(model)
        except AdapterError as e:
            code = {404: "model_not_found", 400: "invalid_adapter"}.get(e.status)
            raise APIError(str(e), e.status, param="model", code=code) from e

    async def engine_info(self) -> EngineInfo:
        """The engine's limits, asked once (the first request waits for the engine to be up)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        info = await self.engine.info()
                    except Exception as e:
                        logger.warning("could not ask the engine for its limits: %r", e)
                        raise APIError(ENGINE_FAILED, 503) from e
                    self._info = EngineInfo(
                        max_model_len=int(info["max_model_len"]),
                        vocab_size=int(info["vocab_size"]),
                        eos_token_ids=tuple(info.get("eos_token_ids", ())),
                    )
        return self._info

    # -- routes ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        arrival = self.metrics.clock()
        adapter = await self.resolve_adapter(body.model)
        info = await self.engine_info()
        if isinstance(body.prompt, str):
            prompt_ids = await self.tokenization.encode_prompt(body.prompt)
        else:
            prompt_ids = list(cast("list[int]", body.prompt))  # `_one_prompt` left one prompt
            bad = [t for t in prompt_ids if not 0 <= t < info.vocab_size]
            if bad:
                raise APIError(
                    f"token id {bad[0]} is outside the vocabulary (0..{info.vocab_size - 1})",
                    param="prompt",
                )
        output = _CompletionOutput(f"cmpl-{uuid.uuid4().hex}", body.model)
        budget = _output_budget(len(prompt_ids), body.max_tokens, info, prompt_param="prompt")
        timer = self.metrics.generation(adapter, arrival)
        return await self._generate(body, budget, prompt_ids, adapter, output, timer)

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival = self.metrics.clock()
        adapter = await self.resolve_adapter(body.model)
        info = await self.engine_info()
        messages = [_template_message(m.role, m.text, m.name) for m in body.messages]
        try:
            prompt_ids = await self.tokenization.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
            )
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from e
        output = _ChatOutput(f"chatcmpl-{uuid.uuid4().hex}", body.model)
        budget = _output_budget(
            len(prompt_ids), body.output_token_limit, info, prompt_param="messages"
        )
        timer = self.metrics.generation(adapter, arrival)
        return await self._generate(body, budget, prompt_ids, adapter, output, timer)

    # -- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        body: SamplingFields,
        max_tokens: int,
        prompt_ids: list[int],
        adapter: str | None,
        output: _Output,
        timer: GenerationTimer,
    ) -> Response:
        sampling = _sampling_params(body, max_tokens, await self.engine_info())
        request = GenerateRequest(output.request_id, prompt_ids, sampling, adapter)
        text = TextStream(self.tokenizer, prompt_ids, body.stop_strings)
        stream = aiter(self.engine.generate(request))
        try:
            first = await _next_chunk(stream)
            timer.tokens(len(first.token_ids))
            _raise_engine_error(first)
        except APIError as e:
            await _close(stream)
            if e.status == 404 and adapter is not None:
                # Unloaded through another ingress replica: stop sending it from here too.
                self.registry.remove(adapter)
            raise
        except BaseException:
            await _close(stream)
            raise
        run = _Run(stream, first, text, len(prompt_ids), timer)
        if body.stream:
            return _ClosingStreamingResponse(
                _sse_events(run, output, body.include_usage),
                on_close=run.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            pieces = [delta async for delta, _ in run]
        finally:
            await run.close()
        usage = UsageInfo.of(run.num_prompt_tokens, run.num_output_tokens)
        return JSONResponse(output.response("".join(pieces), run.finish_reason, usage).model_dump())


def _template_message(role: str, content: str, name: str | None) -> dict[str, str]:
    # Most chat templates predate the "developer" role, which OpenAI defines as the new "system".
    message = {"role": "system" if role == "developer" else role, "content": content}
    if name is not None:
        message["name"] = name
    return message


def _output_budget(
    num_prompt_tokens: int, max_tokens: int | None, info: EngineInfo, *, prompt_param: str
) -> int:
    """Tokens the request may generate: `max_tokens`, or what the context has left when it is
    null. An empty prompt, a prompt that leaves no room, or a `max_tokens` beyond the context
    is a 400. (A `max_tokens` below 1 is left to SamplingParams to refuse.)"""
    if num_prompt_tokens == 0:
        raise APIError(
            "the prompt is empty: it must encode to at least one token", param=prompt_param
        )
    limit = info.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please reduce "
            "the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - num_prompt_tokens
    if max_tokens >= 1 and num_prompt_tokens + max_tokens > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _sampling_params(body: SamplingFields, max_tokens: int, info: EngineInfo) -> SamplingParams:
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < info.vocab_size]
    if bad:
        raise APIError(
            f"stop token id {bad[0]} is outside the vocabulary (0..{info.vocab_size - 1})",
            param="stop_token_ids",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k_or_none,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as e:
        raise APIError(str(e)) from e


async def _next_chunk(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
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


def _raise_engine_error(chunk: GenerateChunk) -> None:
    """An engine refusal as the client's error; an engine fault (500) as a plain one, its
    message (which may carry internals) to the log."""
    error = chunk.error
    if error is not None and error.status != 500:
        raise APIError(error.message, error.status, type=error.type)
    if chunk.finish_reason == "error":
        if error is not None:
            logger.error("request %s failed in the engine: %s", chunk.request_id, error.message)
        raise APIError(INTERNAL_ERROR, 500)


async def _close(stream: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class _Run:
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

    async def __aiter__(self) -> AsyncIterator[tuple[str, str | None]]:
        while self.finish_reason is None:
            if self._first is not None:
                chunk, self._first = self._first, None
            else:
                chunk = await _next_chunk(self._stream)
                self._timer.tokens(len(chunk.token_ids))
            _raise_engine_error(chunk)
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
        await _close(self._stream)


# ---------------------------------------------------------------------------------------------
# Output shapes


class _Output(Protocol):
    request_id: str

    def opening(self) -> list[BaseModel]: ...

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel: ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel: ...


class _CompletionOutput:
    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel:
        return CompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
        )

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
            usage=usage,
        )


class _ChatOutput:
    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _stream_response(self, delta: DeltaMessage, finish_reason: str | None) -> BaseModel:
        return ChatCompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish_reason)],
        )

    def opening(self) -> list[BaseModel]:
        return [self._stream_response(DeltaMessage(role="assistant", content=""), None)]

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel:
        return self._stream_response(DeltaMessage(content=text or None), finish_reason)

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> BaseModel:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatCompletionChoice(
                    message=AssistantMessage(content=text), finish_reason=finish_reason
                )
            ],
            usage=usage,
        )


# ---------------------------------------------------------------------------------------------
# Server-sent events

DONE_EVENT = "data: [DONE]\n\n"


def _sse(payload: BaseModel, *, include_usage: bool) -> str:
    exclude = None if include_usage else {"usage"}
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


async def _sse_events(run: _Run, output: _Output, include_usage: bool) -> AsyncIterator[str]:
    """The response body of a streamed generation, ending with `data: [DONE]`."""
    try:
        for opening in output.opening():
            yield _sse(opening, include_usage=include_usage)
        async for delta, finish_reason in run:
            yield _sse(output.chunk(delta, finish_reason), include_usage=include_usage)
        if include_usage:
            usage = UsageInfo.of(run.num_prompt_tokens, run.num_output_tokens)
            yield _sse(output.usage_chunk(usage), include_usage=True)
    except APIError as e:
        yield f"data: {json.dumps(e.to_response().model_dump())}\n\n"
    except Exception:
        logger.exception("streaming request %s failed", output.request_id)
        error = APIError(INTERNAL_ERROR, 500)
        yield f"data: {json.dumps(error.to_response().model_dump())}\n\n"
    finally:
        await run.close()
    yield DONE_EVENT


class _ClosingStreamingResponse(StreamingResponse):
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


# ---------------------------------------------------------------------------------------------
# The Serve deployment


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress()
class Ingress:
    """The HTTP ingress replica. Construction only stores its collaborators; start-up (Serve
    calls `__serve_build_asgi_app__` after the constructor) runs `prepare` on this node (making
    sure the model files exist, e.g. building the demo), loads the tokenizer from `model_dir`,
    reads the model's context length when none was configured (it sizes the body limit) and
    builds the app."""

    def __init__(
        self,
        engine: DeploymentHandle,
        settings: ApiSettings,
        model_dir: str,
        *,
        prepare: Callable[[], object] | None = None,
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._model_dir = model_dir
        self._prepare = prepare

    async def __serve_build_asgi_app__(self) -> FastAPI:
        if self._prepare is not None:
            await asyncio.to_thread(self._prepare)
        tokenizer = await asyncio.to_thread(load_tokenizer, self._model_dir)
        settings = self._settings
        if settings.max_model_len is None:
            max_len = await asyncio.to_thread(model_context_length, self._model_dir)
            settings = dataclasses.replace(settings, max_model_len=max_len)
        return make_api(
            ServeEngineClient(self._engine), tokenizer, settings, metrics=IngressMetrics()
        )


def model_context_length(model_dir: str | Path) -> int | None:
    """`max_position_embeddings` from the model folder's config.json, when it says."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        value = config.get(
            "max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings")
        )
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
