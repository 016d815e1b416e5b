"""The Ray Serve deployment that wraps one engine replica. The only Ray code in `replicas/`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from ray import serve

from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.protocol import GenerateChunk, GenerateRequest

logger = logging.getLogger("ray.serve")


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10)
class EngineDeployment:
    """One engine replica. `prepare` runs first on the replica's node (it makes sure the model
    files exist there, e.g. building the embedded demo); `engine_cls` is injectable for tests."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        prepare: Callable[[], object] | None = None,
        engine_cls: type[Engine] = Engine,
    ) -> None:
        if prepare is not None:
            prepare()
        self.config = config
        self.engine = AsyncEngine(engine_cls(config))
        self.engine.start()
        logger.info("engine replica ready on %s with model %s", config.device, config.model)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.engine.generate(request):
            yield chunk

    async def info(self) -> dict:
        engine = self.engine.engine
        return {
            "max_model_len": engine.max_model_len,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "vocab_size": engine.spec.vocab_size,
        }

    async def stats(self) -> dict:
        return await self.engine.call(_engine_stats)

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Raises RequestRejected (with `.status`) for a bad adapter or a name in use."""
        await self.engine.call(Engine.load_adapter, name, path, pinned)

    async def unload_adapter(self, name: str) -> None:
        await self.engine.call(Engine.unload_adapter, name)

    async def adapters(self) -> dict[str, dict]:
        return await self.engine.call(Engine.adapter_status)

    async def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        await self.engine.call(Engine.prefetch_hint, adapter, eta_s)

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"engine loop stopped: {self.engine.last_error!r}")

    def __del__(self) -> None:
        self.engine.shutdown()


def _engine_stats(engine: Engine) -> dict:
    stats = engine.adapters.stats
    return {
        "num_steps": engine.num_steps,
        "max_adapters_in_step": engine.max_adapters_in_step,
        "adapter_disk_reads": stats.disk_reads,
        "adapter_gpu_loads": stats.gpu_loads,
        "adapter_prefetch_loads": stats.prefetch_loads,
        "adapter_hits": stats.hits,
        "adapter_misses": stats.misses,
        "resident_adapters": engine.adapters.slots.resident,
        "num_free_kv_blocks": engine.blocks.num_free,
        "num_kv_blocks": engine.blocks.num_blocks,
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
    }
