"""The HTTP app: FastAPI's wiring of the OpenAI-compatible routes over `OpenAIService`.

`make_api(engine, tokenizer, settings, metrics=...)` builds the app from its collaborators, so
tests run it with a fake engine, a fake metrics backend and no Ray (`app/ingress.py` is the Serve
deployment around it). Before a route runs, `app/guards.py` checks the API key (when one is set)
and bounds the body. Every failure answers in OpenAI's error body, JSON, with the status the
OpenAPI schema declares for the route; a failure of ours (an engine replica died, a bug) says so
without internals, which go to the log.

The routes' logic is in `app/service.py`; adapter management (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/v1/adapters`) in `app/management.py`; the metrics in
`app/metrics.py`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from app.guards import ApiKeyGuard, BodyLimit, default_body_limit
from app.metrics import IngressMetrics, RequestCounter
from app.protocol import (
    INTERNAL_ERROR,
    AdapterList,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelList,
    UnloadLoraAdapterRequest,
)
from app.service import EngineClient, OpenAIService
from app.tokenization import TokenizerPool
from replicas import hop_log

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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


class _HopStamps:
    """ASGI middleware of a diagnostic run (`replicas.hop_log`): when a request reached the app,
    before its body is read."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            hop_log.stamp("ingress_asgi")
        await self.app(scope, receive, send)


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
    if hop_log.enabled():
        api.add_middleware(_HopStamps)

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
