"""Which adapters the app serves, and which adapter (if any) a request's `model` names.

Folder validation is the engine's own (`replicas.adapters.loader.read_adapter_config`), so the
ingress refuses exactly the adapters an engine replica would refuse, before a request is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from replicas.adapters.loader import AdapterError, read_adapter_config

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterRegistry",
    "check_adapter_name",
    "validate_adapter_dir",
]


@dataclass(frozen=True)
class AdapterInfo:
    """What the app knows of a valid adapter folder (the engine reads the weights)."""

    path: Path
    rank: int  # the largest rank over its modules
    lora_alpha: float
    target_modules: tuple[str, ...]


def validate_adapter_dir(path: str | Path, max_lora_rank: int) -> AdapterInfo:
    """Check a PEFT LoRA folder without reading its weights.

    Raises `AdapterError` (status 404 when the folder does not exist, 400 otherwise): no or
    unparsable adapter_config.json, peft_type other than LORA, a rank above `max_lora_rank`, a
    target outside q/k/v/o/gate/up/down_proj, or no adapter_model.safetensors (pickle `.bin`
    weights are refused).
    """
    config = read_adapter_config(path, max_lora_rank)
    return AdapterInfo(
        path=config.path,
        rank=max([config.rank, *config.rank_pattern.values()]),
        lora_alpha=config.lora_alpha,
        target_modules=config.target_modules,
    )


def check_adapter_name(name: str, base_name: str) -> None:
    """Raise ValueError unless `name` can name an adapter: non-empty, a single path component
    (it names a folder under `adapter_root`), no ':' (it separates `base:adapter`), not hidden,
    and not the base model's name."""
    if not name or not name.strip():
        raise ValueError("adapter names must be non-empty")
    if any(c in name for c in "/\\:\0"):
        raise ValueError(f"adapter name {name!r} must not contain '/', '\\', ':' or NUL")
    if name.startswith("."):
        raise ValueError(f"adapter name {name!r} must not start with '.'")
    if name == base_name:
        raise ValueError(f"adapter name {name!r} is the base model's name")


class AdapterRegistry:
    """The adapters served by name: those configured at start-up (already validated) and those
    found under `adapter_root` on first use. Lives on the ingress event loop; not thread-safe.

    A folder under `adapter_root` that fails validation is not remembered, so a fixed folder is
    picked up by the next request that names it.
    """

    def __init__(
        self,
        base_name: str,
        adapters: Mapping[str, str | Path],
        *,
        adapter_root: str | Path | None,
        max_lora_rank: int,
    ) -> None:
        self.base_name = base_name
        self.adapter_root = Path(adapter_root) if adapter_root is not None else None
        self.max_lora_rank = max_lora_rank
        self._paths: dict[str, Path] = {name: Path(path) for name, path in adapters.items()}

    @property
    def adapters(self) -> dict[str, Path]:
        """Name -> folder of every adapter known so far."""
        return dict(self._paths)

    async def resolve(self, model: str) -> str | None:
        """The adapter `model` names, or None for the base model.

        Accepted: the base name, an adapter name, `"<base>:<adapter>"`, or the name of a folder
        under `adapter_root` (validated on first use). Raises `AdapterError`: 404 for an unknown
        model, 400 for an adapter folder that exists but cannot be served.
        """
        if model == self.base_name:
            return None
        name = model
        prefix = f"{self.base_name}:"
        if model not in self._paths and model.startswith(prefix):
            name = model[len(prefix) :]
        if name in self._paths:
            return name
        await self._discover(name, model)
        return name

    async def _discover(self, name: str, model: str) -> None:
        not_found = AdapterError(f"The model `{model}` does not exist.", status=404)
        if self.adapter_root is None:
            raise not_found
        try:
            check_adapter_name(name, self.base_name)
        except ValueError:
            raise not_found from None
        # Off the event loop: adapter_root may sit on a network file system.
        try:
            info = await asyncio.to_thread(
                validate_adapter_dir, self.adapter_root / name, self.max_lora_rank
            )
        except AdapterError as e:
            if e.status == 404:
                raise not_found from e
            raise AdapterError(f"adapter `{name}` cannot be served: {e}", e.status) from e
        self._paths[name] = info.path
