"""The engine's adapter manager: name -> path -> host weights -> GPU slot.

Implements the scheduler's `AdapterGate`. Resolution order for a name: adapters registered at
start-up or through `register`, then `adapter_root/<name>`. Loads are synchronous here: the
slot is written before `acquire` returns.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replicas.adapters.host_cache import HostCache
from replicas.adapters.loader import AdapterError, AdapterWeights, load_adapter, read_adapter_config
from replicas.adapters.slot_pool import SlotPool
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from replicas.scheduler import AdapterLoadError

logger = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        spec: ModelSpec,
        weights: LoraWeightPool,
        max_lora_rank: int,
        adapters: dict[str, str],
        adapter_root: str | None,
        max_loaded_loras: int,
        dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.max_lora_rank = max_lora_rank
        self.adapter_root = Path(adapter_root) if adapter_root else None
        self.dtype = dtype
        self.paths: dict[str, Path] = {name: Path(p) for name, p in adapters.items()}
        self.slots = SlotPool(weights.num_slots)
        self.host: HostCache[AdapterWeights] = HostCache(max_loaded_loras)
        self.num_loads = 0

    def resolve(self, name: str) -> Path:
        """The adapter's folder, checked cheaply (config and files). Raises AdapterError."""
        path = self.paths.get(name)
        if (
            path is None
            and self.adapter_root is not None
            and "/" not in name
            and name not in (".", "..")
        ):
            candidate = self.adapter_root / name
            if candidate.is_dir():
                path = candidate
        if path is None:
            raise AdapterError(f"the model {name!r} does not exist", status=404)
        read_adapter_config(path, self.max_lora_rank)
        return path

    def is_resident(self, adapter: str) -> bool:
        return adapter in self.slots

    def acquire(self, adapter: str) -> int | None:
        if adapter not in self.slots:
            if not self.slots.can_assign():
                return None
            weights = self._host_weights(adapter)
            assignment = self.slots.assign(adapter)
            if assignment.evicted is not None:
                logger.debug("adapter %s leaves slot %d", assignment.evicted, assignment.slot)
            self.weights.write(assignment.slot, weights)
        return self.slots.hold(adapter)

    def release(self, adapter: str) -> None:
        self.slots.release(adapter)

    def _host_weights(self, adapter: str) -> AdapterWeights:
        weights = self.host.get(adapter)
        if weights is None:
            try:
                path = self.resolve(adapter)
                weights = load_adapter(adapter, path, self.spec, self.max_lora_rank, self.dtype)
            except AdapterError as e:
                raise AdapterLoadError(str(e)) from e
            self.host.put(adapter, weights)
            self.num_loads += 1
        return weights
