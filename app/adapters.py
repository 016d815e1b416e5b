"""Which adapters the app serves, and which adapter (if any) a request's `model` names.

Folder validation is the engine's own (`check_adapter_files` of `replicas/adapters/layout.py`: the
config, and the weights file's header and tensor layout against it), so the ingress refuses the
adapters an engine replica would refuse before a load is broadcast or a request queued; only what
needs the model's sizes (layer count, in/out features) is left to the engine replicas' own check at
load. It imports no torch.

The engine replicas are the authority on which adapters are served: adapters loaded or unloaded
at run time reach every engine replica (`app/management.py`), while each ingress replica keeps a
registry of its own. An ingress learns what another one changed from an engine replica's view
(`FleetView`): on a name it does not know, on `/v1/models` and `/v1/adapters`, and when an engine
answers 404 for an adapter it still lists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from replicas.adapters.hub import HubRef, Location, location_of
from replicas.adapters.layout import check_adapter_files
from replicas.adapters.peft_config import AdapterError
from replicas.errors import ErrorKind

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterRegistry",
    "FleetView",
    "RegisteredAdapter",
    "check_adapter_name",
    "validate_adapter_dir",
]

logger = logging.getLogger("ray.serve")

FLEET_VIEW_TIMEOUT_S = 2.0
MAX_ADAPTER_NAME_BYTES = 255  # a folder name under adapter_root (NAME_MAX)

# hub: named by a request as `org/name[@revision]` and fetched on first use (`app/hub.py`)
Source = Literal["config", "runtime", "adapter_root", "hub"]


@dataclass(frozen=True)
class AdapterInfo:
    """What the app knows of a valid adapter folder (the engine reads the weights)."""

    path: Path
    rank: int  # the largest rank over its modules
    lora_alpha: float
    target_modules: tuple[str, ...]


def validate_adapter_dir(path: str | Path, max_lora_rank: int) -> AdapterInfo:
    """Check a PEFT LoRA folder without reading its tensors (the weights file's header only).

    Raises `AdapterError` (NOT_FOUND when the folder does not exist, INVALID otherwise): no or
    unparsable adapter_config.json, peft_type other than LORA, a rank above `max_lora_rank`, a
    target outside q/k/v/o/gate/up/down_proj, no adapter_model.safetensors (pickle `.bin`
    weights are refused), a weights file that is not well-formed safetensors (truncated, a
    header too large), or tensors that disagree with the config (names, dtypes, ranks, a
    target without its weights).
    """
    config = check_adapter_files(Path(path).name, path, max_lora_rank)
    return AdapterInfo(
        path=config.path,
        rank=max([config.rank, *config.rank_pattern.values()]),
        lora_alpha=config.lora_alpha,
        target_modules=config.target_modules,
    )


def check_adapter_name(name: str, base_name: str) -> None:
    """Raise ValueError unless `name` can name an adapter: non-empty, a single path component
    of at most 255 bytes (it names a folder under `adapter_root`), no ':' (it separates
    `base:adapter`), not hidden, and not the base model's name."""
    if not name or not name.strip():
        raise ValueError("adapter names must be non-empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_ADAPTER_NAME_BYTES:
        raise ValueError(f"adapter names must be at most {MAX_ADAPTER_NAME_BYTES} bytes long")
    if any(c in name for c in "/\\:\0"):
        raise ValueError(f"adapter name {name!r} must not contain '/', '\\', ':' or NUL")
    if name.startswith("."):
        raise ValueError(f"adapter name {name!r} must not start with '.'")
    if name == base_name:
        raise ValueError(f"adapter name {name!r} is the base model's name")


@dataclass(frozen=True)
class FleetView:
    """One engine replica's answer to "which adapters may new requests name?": the adapters
    registered by name (configured or loaded at run time) and the names unloaded (which
    `adapter_root` folders no longer provide either)."""

    adapters: Mapping[str, str] = field(default_factory=dict)
    unloaded: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RegisteredAdapter:
    path: Location  # a folder, or a hub adapter pinned to a commit
    source: Source  # configured at start-up, loaded at run time, or found under adapter_root


class AdapterRegistry:
    """The adapters served by name: those configured at start-up (already validated), those
    loaded at run time, and those found under `adapter_root` on first use. Lives on the ingress
    event loop; not thread-safe.

    A folder under `adapter_root` that fails validation is not remembered, so a fixed folder is
    picked up by the next request that names it. A name unloaded is not looked for under
    `adapter_root` again until it is loaded again.

    `fleet_view` (optional) fetches an engine replica's `FleetView`; `refresh` applies it. It is
    asked when a name is not known here, so an adapter loaded through another ingress replica is
    found; at most one fetch is in flight, callers that miss meanwhile share its answer.

    `serve_from_hub` (optional) is asked last about a name nobody serves: it starts serving the
    hub adapter the name is (`org/name[@revision]`, when allowed) across the fleet and returns
    True, or returns False (a 404), or raises AdapterError (404, 400, 503).
    """

    def __init__(
        self,
        base_name: str,
        adapters: Mapping[str, str | Path],
        *,
        adapter_root: str | Path | None,
        max_lora_rank: int,
        fleet_view: Callable[[], Awaitable[FleetView]] | None = None,
        serve_from_hub: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.base_name = base_name
        self.adapter_root = Path(adapter_root) if adapter_root is not None else None
        self.max_lora_rank = max_lora_rank
        self._configured = {name: location_of(path) for name, path in adapters.items()}
        self._entries: dict[str, RegisteredAdapter] = {
            name: RegisteredAdapter(path, "config") for name, path in self._configured.items()
        }
        self._unloaded: set[str] = set()
        self._fleet_view = fleet_view
        self._serve_from_hub = serve_from_hub
        self._refreshing: asyncio.Future[None] | None = None

    @property
    def adapters(self) -> dict[str, Location]:
        """Name -> folder (or hub reference) of every adapter known so far."""
        return {name: entry.path for name, entry in self._entries.items()}

    @property
    def entries(self) -> dict[str, RegisteredAdapter]:
        return dict(self._entries)

    def is_taken(self, name: str) -> bool:
        """True when `name` already names an adapter: a known one, or a folder under
        `adapter_root` that was not unloaded."""
        if name == self.base_name or name in self._entries:
            return True
        return name not in self._unloaded and self._root_folder(name) is not None

    def add(self, name: str, path: str | Location, source: Source = "runtime") -> None:
        """An adapter loaded at run time (or served from the hub on first use)."""
        self._entries[name] = RegisteredAdapter(location_of(path), source)
        self._unloaded.discard(name)

    def remove(self, name: str) -> None:
        """New requests for `name` get 404 from now on (`adapter_root` included)."""
        self._entries.pop(name, None)
        self._unloaded.add(name)

    def apply(self, view: FleetView) -> None:
        """Take in an engine replica's view. Names it does not mention are left alone: a
        replica started after a run-time load does not know that adapter, which does not make
        it unloaded."""
        for name in view.unloaded:
            if name not in view.adapters:
                self.remove(name)
        for name, path in view.adapters.items():
            location = location_of(path)
            known = self._entries.get(name)
            if known is None or known.path != location:
                self._entries[name] = RegisteredAdapter(location, self._source(name, location))
            self._unloaded.discard(name)

    def _source(self, name: str, location: Location) -> Source:
        if self._configured.get(name) == location:
            return "config"
        # Names with '/' are hub ids: nothing else may contain one (check_adapter_name).
        return "hub" if isinstance(location, HubRef) and "/" in name else "runtime"

    async def refresh(self) -> None:
        """Fetch an engine replica's view and apply it. An engine that does not answer leaves
        the registry as it is (logged)."""
        if self._fleet_view is None:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._fetch_and_apply())
            self._refreshing.add_done_callback(self._refresh_done)
        await asyncio.shield(self._refreshing)

    def _refresh_done(self, _: asyncio.Future[None]) -> None:
        self._refreshing = None

    async def _fetch_and_apply(self) -> None:
        assert self._fleet_view is not None
        try:
            view = await asyncio.wait_for(self._fleet_view(), FLEET_VIEW_TIMEOUT_S)
        except Exception as e:
            logger.warning("could not ask the engine which adapters it serves: %r", e)
            return
        self.apply(view)

    async def resolve(self, model: str) -> str | None:
        """The adapter `model` names, or None for the base model.

        Accepted: the base name, an adapter name, `"<base>:<adapter>"`, the name of a folder
        under `adapter_root` (validated on first use), or an allowed hub adapter
        (`serve_from_hub`). Raises `AdapterError`: 404 for an unknown model, 400 for an adapter
        that exists but cannot be served, 503 for a hub that does not answer.
        """
        if model == self.base_name:
            return None
        name = model
        prefix = f"{self.base_name}:"
        if model not in self._entries and model.startswith(prefix):
            name = model[len(prefix) :]
        if name in self._entries:
            return name
        if name not in self._unloaded and await self._discover(name):
            return name
        await self.refresh()  # loaded through another ingress replica?
        if name in self._entries:
            return name
        if name not in self._unloaded and self._serve_from_hub is not None:
            try:
                if await self._serve_from_hub(name):
                    return name
            except AdapterError as e:
                raise AdapterError(f"The model `{model}` cannot be served: {e}", e.kind) from e
        raise AdapterError(f"The model `{model}` does not exist.", ErrorKind.NOT_FOUND)

    def _root_folder(self, name: str) -> Path | None:
        if self.adapter_root is None:
            return None
        try:
            check_adapter_name(name, self.base_name)
        except ValueError:
            return None
        folder = self.adapter_root / name
        return folder if folder.is_dir() else None

    async def _discover(self, name: str) -> bool:
        """True when `name` is a servable folder under `adapter_root` (now remembered); False
        when there is no such folder. Raises AdapterError (400) for a folder that cannot be
        served."""
        if self.adapter_root is None:
            return False
        try:
            check_adapter_name(name, self.base_name)
        except ValueError:
            return False
        # Off the event loop: adapter_root may sit on a network file system.
        try:
            info = await asyncio.to_thread(
                validate_adapter_dir, self.adapter_root / name, self.max_lora_rank
            )
        except AdapterError as e:
            if e.kind is ErrorKind.NOT_FOUND:
                return False
            raise AdapterError(f"adapter `{name}` cannot be served: {e}", e.kind) from e
        self._entries[name] = RegisteredAdapter(info.path, "adapter_root")
        return True
