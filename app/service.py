"""The OpenAI routes' logic, apart from FastAPI's wiring (`app/api.py`).

Each generation: resolve `model` to the base or an adapter, tokenize (chat template for chat),
check the prompt against the engine's limits, send one `GenerateRequest` to the engine, and turn
its token chunks into text (`app/streaming.py`). The first chunk is awaited before answering, so
a request the engine refuses gets a proper status. Tokenization and chat templates run on worker
threads (`TokenizerPool`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, cast

from fastapi.responses import JSONResponse, Response

from app.adapters import AdapterError, AdapterRegistry
from app.engine_client import ENGINE_FAILED
from app.fleet import FleetClient
from app.hub import HubAdapters
from app.management import AdapterAdmin
from app.metrics import GenerationTimer, IngressMetrics
from app.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from app.streaming import (
    ChatOutput,
    ClosingStreamingResponse,
    CompletionOutput,
    Generation,
    OutputShape,
    close_stream,
    next_chunk,
    raise_engine_error,
    sse_events,
)
from app.tokenization import ChatTemplateError, TextStream, TokenizerPool
from replicas import hop_log
from replicas.adapters.hub import HubAccess
from replicas.errors import ErrorKind
from replicas.limits import EngineLimits, LimitExceeded
from replicas.protocol import GenerateChunk, GenerateRequest
from replicas.request import SamplingParams

if TYPE_CHECKING:
    from app.api import ApiSettings

logger = logging.getLogger("ray.serve")


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


class OpenAIService:
    """The routes' logic: the models list, and generation for completions and chat."""

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
        self._limits: EngineLimits | None = None
        self._limits_lock = asyncio.Lock()

    # -- models ------------------------------------------------------------------------------

    async def models(self) -> ModelList:
        """The base model and every adapter served by name (adapter_root folders once used),
        as the engine fleet knows them."""
        await self.registry.refresh()
        base = self.settings.served_model_name
        max_len = self._limits.max_model_len if self._limits is not None else None
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
            code = {ErrorKind.NOT_FOUND: "model_not_found", ErrorKind.INVALID: "invalid_adapter"}
            raise APIError.of(e.kind, str(e), param="model", code=code.get(e.kind)) from e

    async def engine_limits(self) -> EngineLimits:
        """The engine's limits, asked once (the first request waits for the engine to be up)."""
        if self._limits is None:
            async with self._limits_lock:
                if self._limits is None:
                    try:
                        info = await self.engine.info()
                    except Exception as e:
                        logger.warning("could not ask the engine for its limits: %r", e)
                        raise APIError(ENGINE_FAILED, 503) from e
                    self._limits = EngineLimits(
                        max_model_len=int(info["max_model_len"]), vocab_size=int(info["vocab_size"])
                    )
        return self._limits

    # -- routes ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        arrival = self.metrics.clock()
        hop_log.stamp("ingress_handler")
        adapter = await self.resolve_adapter(body.model)
        limits = await self.engine_limits()
        if isinstance(body.prompt, str):
            prompt_ids = await self.tokenization.encode_prompt(body.prompt)
        else:
            prompt_ids = list(cast("list[int]", body.prompt))  # `_one_prompt` left one prompt
        sampling = _sampling_params(body, prompt_ids, body.max_tokens, limits, "prompt")
        timer = self.metrics.generation(adapter, arrival)
        output = CompletionOutput(body.model)
        return await self._generate(body, sampling, prompt_ids, adapter, output, timer)

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival = self.metrics.clock()
        adapter = await self.resolve_adapter(body.model)
        limits = await self.engine_limits()
        messages = [_template_message(m.role, m.text, m.name) for m in body.messages]
        try:
            prompt_ids = await self.tokenization.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
            )
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from e
        max_tokens = body.output_token_limit
        sampling = _sampling_params(body, prompt_ids, max_tokens, limits, "messages")
        timer = self.metrics.generation(adapter, arrival)
        output = ChatOutput(body.model)
        return await self._generate(body, sampling, prompt_ids, adapter, output, timer)

    # -- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        body: SamplingFields,
        sampling: SamplingParams,
        prompt_ids: list[int],
        adapter: str | None,
        output: OutputShape,
        timer: GenerationTimer,
    ) -> Response:
        request = GenerateRequest(output.request_id, prompt_ids, sampling, adapter)
        text = TextStream(self.tokenizer, prompt_ids, body.stop_strings)
        stream = aiter(self.engine.generate(request))
        try:
            first = await next_chunk(stream)
            hop_log.stamp("ingress_first")
            timer.tokens(len(first.token_ids))
            raise_engine_error(first)
        except APIError as e:
            timer.close()
            await close_stream(stream)
            if e.status == 404 and adapter is not None:
                # Unloaded through another ingress replica: stop sending it from here too.
                self.registry.remove(adapter)
            raise
        except BaseException:
            timer.close()
            await close_stream(stream)
            raise
        run = Generation(stream, first, text, len(prompt_ids), timer)
        if body.stream:
            return ClosingStreamingResponse(
                sse_events(run, output, body.include_usage),
                on_close=run.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            pieces = [delta async for delta, _ in run]
        finally:
            await run.close()
        response = output.response("".join(pieces), run.finish_reason, run.usage)
        return JSONResponse(response.model_dump())


def _template_message(role: str, content: str, name: str | None) -> dict[str, str]:
    # Most chat templates predate the "developer" role, which OpenAI defines as the new "system".
    message = {"role": "system" if role == "developer" else role, "content": content}
    if name is not None:
        message["name"] = name
    return message


def _sampling_params(
    body: SamplingFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    limits: EngineLimits,
    prompt_param: str,
) -> SamplingParams:
    """The request's sampling parameters, once its prompt and stop token ids fit the engine's
    limits (checked here too, so the client's 400 comes without a call to the engine:
    `replicas/limits.py`)."""
    try:
        budget = limits.output_budget(prompt_ids, max_tokens, prompt_param=prompt_param)
        stop_ids = body.stop_token_ids or ()
        limits.check_token_ids(stop_ids, param="stop_token_ids", what="stop token id")
    except LimitExceeded as e:
        raise APIError(e.message, param=e.param, code=e.code) from e
    try:
        return SamplingParams(
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k_or_none,
            seed=body.seed,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as e:
        raise APIError(str(e)) from e
