"""The Serve deployment of the HTTP ingress: `Ingress` receives the engine deployment's handle,
and at replica start-up (`__serve_build_asgi_app__`) prepares the model files, loads the
tokenizer and builds the app (`app/api.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from ray import serve

from app.api import ApiSettings, make_api
from app.engine_client import ServeEngineClient
from app.metrics import IngressMetrics
from app.tokenization import load_tokenizer

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

__all__ = ["ApiSettings", "Ingress", "engine_handle", "make_api", "model_context_length"]


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
        self._engine = engine_handle(engine)
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


def engine_handle(handle: DeploymentHandle) -> DeploymentHandle:
    """The engine's handle, over gRPC where this replica's settings send calls between
    replicas that way (`RAY_SERVE_USE_GRPC_BY_DEFAULT`, `app.main.REPLICA_ENV`). A handle
    carries its transport in its options, fixed where it was made: the engine's handle reaches
    the ingress built by the driver (`serve run`), whose environment lacks the setting, so it
    would make Ray actor calls. Those cost the ingress about three times the CPU a request in
    Serve's routing (task submission), docs/perf/serving.md."""
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT

    return handle.options(_by_reference=False) if RAY_SERVE_USE_GRPC_BY_DEFAULT else handle


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
