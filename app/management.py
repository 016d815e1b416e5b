"""Adapter management across the engine fleet: load and unload on every replica, and where each
adapter lives.

Load: the name and folder are checked here first (the engine's own checks, `validate_adapter_dir`),
then the load is broadcast with a fresh `load_id`. When any replica fails, the load is undone with
a broadcast unload carrying that `load_id`, which only the replicas where this load landed act on,
so an adapter of the same name loaded by someone else is never touched; the client gets the
error. Unload: broadcast; a replica that answers 404 already does not serve the name. Loads and
unloads through one ingress replica run one at a time.

A `lora_path` of the form `hf://org/name[@revision]` loads from the Hugging Face Hub instead of a
folder (`app/hub.py`): gated by `hub_adapter_repos`, pinned to a commit and checked before the
broadcast, so every replica serves the same weights. A request naming an allowed hub adapter
(`org/name[@revision]`) that nobody serves yet is loaded the same way under that name
(`serve_from_hub`).

Success answers are plain text, as vLLM's are (`Success: LoRA adapter 'x' added successfully.`);
errors are OpenAI error bodies.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from app.adapters import (
    AdapterError,
    AdapterRegistry,
    RegisteredAdapter,
    check_adapter_name,
    validate_adapter_dir,
)
from app.fleet import FleetClient, ReplicaReply
from app.hub import HUB_OFF_MESSAGE, HubAdapters
from app.paths import LOADING_OFF_MESSAGE, PathRefused, resolve_runtime_adapter_path
from app.protocol import (
    AdapterCard,
    AdapterList,
    AdapterPlacement,
    APIError,
    LoadLoraAdapterRequest,
    ReplicaState,
    UnloadLoraAdapterRequest,
)
from replicas.adapters.hub import HUB_SCHEME, HubError, HubRef, Location
from replicas.errors import ErrorKind

logger = logging.getLogger("ray.serve")

DEFAULT_REPORT_TIMEOUT_S = 2.0


class AdapterAdmin:
    """The logic behind /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/adapters."""

    def __init__(
        self,
        fleet: FleetClient,
        registry: AdapterRegistry,
        *,
        report_timeout_s: float = DEFAULT_REPORT_TIMEOUT_S,
        runtime_adapter_dirs: Sequence[str] = (),
        hub: HubAdapters | None = None,
    ) -> None:
        self.fleet = fleet
        self.hub = hub  # None or no repos allowed: no hub adapter at run time
        self.runtime_adapter_dirs = tuple(runtime_adapter_dirs)  # empty: loading is off
        self.registry = registry
        self.report_timeout_s = report_timeout_s
        self._lock = asyncio.Lock()
        self._ranks: dict[Location, int | None] = {}  # from adapter_config.json, by location

    # -- load / unload -----------------------------------------------------------------------

    async def load(self, body: LoadLoraAdapterRequest) -> str:
        name = body.lora_name
        from_hub = body.lora_path.startswith(HUB_SCHEME)
        if not from_hub and not self.runtime_adapter_dirs:
            raise APIError(LOADING_OFF_MESSAGE, 403, param="lora_path")
        if from_hub and (self.hub is None or not self.hub.enabled):
            raise APIError(HUB_OFF_MESSAGE, 403, param="lora_path")
        try:
            check_adapter_name(name, self.registry.base_name)
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_name") from e
        path: Location
        if from_hub:
            path, rank = await self._hub_adapter(name, body.lora_path)
        else:
            path, rank = await self._folder_adapter(name, body.lora_path)
        async with self._lock:
            await self.registry.refresh()  # loaded through another ingress replica?
            if self.registry.is_taken(name):
                raise APIError(
                    f"The lora adapter '{name}' has already been loaded.", 400, param="lora_name"
                )
            load_id = uuid.uuid4().hex
            replies = await self.fleet.broadcast_load_adapter(name, str(path), body.pinned, load_id)
            failed = [r for r in replies if not r.ok]
            if not replies:
                raise APIError("no engine replica is running", 503)
            if failed:
                await self._undo_load(name, load_id)
                error = _fleet_error(f"could not load adapter {name!r}", replies, failed)
                raise APIError.of(error.kind, error.message)
            self.registry.add(name, path)
            self._ranks[path] = rank
        logger.info("loaded adapter %s from %s on %d replica(s)", name, path, len(replies))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _folder_adapter(self, name: str, lora_path: str) -> tuple[Path, int]:
        try:  # absolute and resolved: replicas do not share our cwd
            path = await asyncio.to_thread(
                resolve_runtime_adapter_path, lora_path, self.runtime_adapter_dirs
            )
        except PathRefused as e:
            raise APIError(str(e), 400, param="lora_path") from e
        try:
            info = await asyncio.to_thread(validate_adapter_dir, path, self.registry.max_lora_rank)
        except AdapterError as e:
            raise APIError.of(
                e.kind, f"cannot load adapter {name!r}: {e}", param="lora_path"
            ) from e
        return path, info.rank

    async def _hub_adapter(self, name: str, lora_path: str) -> tuple[HubRef, int]:
        """`lora_path` (`hf://org/name[@revision]`) pinned and checked: 400 for a malformed or
        not allowed reference (one message, as for folders), else the hub's answer."""
        assert self.hub is not None
        try:
            ref = HubRef.parse(lora_path)
        except ValueError:
            ref = None
        if ref is None or not self.hub.allowed(ref):
            raise APIError(
                "lora_path must name a hub repo this server may fetch adapters from (the app "
                "arg hub_adapter_repos), as hf://org/name or hf://org/name@revision",
                400,
                param="lora_path",
            )
        try:
            adapter = await self.hub.inspect(ref)
        except HubError as e:
            raise APIError.of(
                e.kind, f"cannot load adapter {name!r}: {e}", param="lora_path"
            ) from e
        return adapter.ref, adapter.rank

    async def serve_from_hub(self, name: str) -> bool:
        """Serve the hub adapter `name` is (`org/name[@revision]`) on every engine replica, under
        that name, pinned to the commit its revision names now. False when `name` is no hub id
        this app may fetch. Raises AdapterError: the hub's 404, 400 or 503, or the fleet's
        refusal. Two ingress replicas doing this at once end with one load (the other's
        broadcast is refused as a name in use, and undone where it landed)."""
        if self.hub is None:
            return False
        ref = self.hub.requested(name)
        if ref is None:
            return False
        adapter = await self.hub.inspect(ref)
        async with self._lock:
            if name in self.registry.entries:  # a request that asked at the same time
                return True
            await self.registry.refresh()  # or through another ingress replica
            if name in self.registry.entries:
                return True
            load_id = uuid.uuid4().hex
            location = str(adapter.ref)
            replies = await self.fleet.broadcast_load_adapter(name, location, False, load_id)
            failed = [r for r in replies if not r.ok]
            if not replies:
                raise AdapterError("no engine replica is running", ErrorKind.UNAVAILABLE)
            if failed:
                await self._undo_load(name, load_id)
                await self.registry.refresh()
                if name in self.registry.entries:
                    return True
                raise _fleet_error(f"could not load adapter {name!r}", replies, failed)
            self.registry.add(name, adapter.ref, "hub")
            self._ranks[adapter.ref] = adapter.rank
        logger.info("serving hub adapter %s on %d replica(s)", adapter.ref, len(replies))
        return True

    async def _undo_load(self, name: str, load_id: str) -> None:
        replies = await self.fleet.broadcast_unload_adapter(name, load_id)
        stuck = [r for r in replies if not r.ok and r.kind is not ErrorKind.NOT_FOUND]
        if stuck:
            logger.error(
                "undoing the partial load of adapter %s failed on %d replica(s): %s",
                name,
                len(stuck),
                stuck[0].detail,
            )

    async def unload(self, body: UnloadLoraAdapterRequest) -> str:
        name = body.lora_name
        if name == self.registry.base_name:
            raise APIError("the base model cannot be unloaded", 400, param="lora_name")
        not_found = APIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        try:
            check_adapter_name(name, self.registry.base_name)
        except ValueError:
            if not _hub_name(name):  # served from the hub on first use: `org/name[@rev]`
                raise not_found from None
        async with self._lock:
            replies = await self.fleet.broadcast_unload_adapter(name)
            if not replies:
                raise APIError("no engine replica is running", 503)
            done = [r for r in replies if r.ok]
            failed = [r for r in replies if not r.ok and r.kind is not ErrorKind.NOT_FOUND]
            if done or not failed:
                # Gone from (at least part of) the fleet: this ingress stops sending it now.
                self.registry.remove(name)
            if failed:
                error = _fleet_error(f"could not unload adapter {name!r}", replies, failed)
                raise APIError.of(error.kind, error.message)
            if not done:
                raise not_found
        logger.info("unloaded adapter %s on %d replica(s)", name, len(done))
        return f"Success: LoRA adapter '{name}' removed successfully."

    # -- listing -------------------------------------------------------------------------------

    async def listing(self) -> AdapterList:
        """Every adapter with rank and size, and per replica its tier. A replica that does not
        answer in time is listed as unavailable."""
        replies, _ = await asyncio.gather(
            self.fleet.adapter_reports(self.report_timeout_s), self.registry.refresh()
        )
        replicas = [_replica_state(r) for r in replies]
        reports = [
            (state.replica_id, r.value["adapters"] if state.available else None)
            for state, r in zip(replicas, replies, strict=True)
        ]
        entries = self.registry.entries
        names = set(entries)
        for _, statuses in reports:
            names |= {n for n, s in (statuses or {}).items() if not s.get("unloading")}
        cards = [await self._card(name, entries, reports) for name in sorted(names)]
        return AdapterList(data=cards, replicas=replicas)

    async def _card(
        self,
        name: str,
        entries: Mapping[str, RegisteredAdapter],
        reports: list[tuple[str | None, dict[str, dict] | None]],
    ) -> AdapterCard:
        entry = entries.get(name)
        root = self.registry.adapter_root
        if entry is not None:
            source, path = entry.source, entry.path
        elif root is not None and (root / name).is_dir():
            source, path = "adapter_root", root / name
        else:
            source, path = "runtime", None  # loaded through another ingress, not yet seen here
        placements: list[AdapterPlacement] = []
        known: list[dict] = []
        for replica_id, statuses in reports:
            if statuses is None:
                placements.append(AdapterPlacement(replica_id=replica_id, tier="unavailable"))
            elif name in statuses:
                status = statuses[name]
                known.append(status)
                placements.append(
                    AdapterPlacement(
                        replica_id=replica_id, tier=status["tier"], slot=status.get("slot")
                    )
                )
            else:
                # Under adapter_root an engine finds it on first use; otherwise it is missing.
                tier: Literal["disk", "absent"] = "disk" if source == "adapter_root" else "absent"
                placements.append(AdapterPlacement(replica_id=replica_id, tier=tier))
        rank = next((s["rank"] for s in known if s.get("rank") is not None), None)
        if rank is None and isinstance(path, HubRef):
            rank = self._ranks.get(path)
        elif rank is None and isinstance(path, Path):
            rank = await self._config_rank(path)
        return AdapterCard(
            id=name,
            source=source,
            path=None if path is None else str(path),
            rank=rank,
            size_bytes=next((s["size_bytes"] for s in known if s.get("size_bytes")), None),
            pinned=any(s.get("pinned") for s in known),
            replicas=placements,
        )

    async def _config_rank(self, path: Path) -> int | None:
        if path not in self._ranks:
            try:
                info = await asyncio.to_thread(
                    validate_adapter_dir, path, self.registry.max_lora_rank
                )
            except AdapterError:
                return None  # not remembered: the folder may be fixed
            self._ranks[path] = info.rank
        return self._ranks[path]


def _hub_name(name: str) -> bool:
    try:
        HubRef.parse(name)
    except ValueError:
        return False
    return not name.startswith(HUB_SCHEME)


def _replica_state(reply: ReplicaReply) -> ReplicaState:
    if not reply.ok:
        logger.warning("engine replica %s did not report: %s", reply.replica_id, reply.detail)
        return ReplicaState(replica_id=reply.replica_id, available=False, error=reply.reason)
    if reply.value.get("adapters") is None:
        error = reply.value.get("error") or "no answer from its engine"
        return ReplicaState(replica_id=reply.replica_id, available=False, error=error)
    return ReplicaState(replica_id=reply.replica_id, available=True)


def _fleet_error(
    what: str, replies: list[ReplicaReply], failed: list[ReplicaReply]
) -> AdapterError:
    """One error for a broadcast that failed on some replicas: the replicas' own kind when they
    all refused alike (INVALID bad adapter or name in use, NOT_FOUND), else UNAVAILABLE."""
    logger.warning("%s on %d of %d engine replica(s): %s", what, len(failed), len(replies),
                   failed[0].detail)  # fmt: skip
    kinds = {r.kind for r in failed}
    alike = kinds.pop() if len(kinds) == 1 else None
    kind = alike if alike is not None else ErrorKind.UNAVAILABLE
    message = f"{what} on {len(failed)} of {len(replies)} engine replica(s): {failed[0].reason}"
    return AdapterError(message, kind)
