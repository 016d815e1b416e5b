"""Adapter management across the engine fleet: load and unload on every replica, and where each
adapter lives.

Load: the name and folder are checked here first (the engine's own checks, `validate_adapter_dir`),
then the load is broadcast with a fresh `load_id`. When any replica fails, the load is undone with
a broadcast unload carrying that `load_id`, which only the replicas where this load landed act on,
so an adapter of the same name loaded by someone else is never touched; the client gets the
error. Unload: broadcast; a replica that answers 404 already does not serve the name. Loads and
unloads through one ingress replica run one at a time.

Success answers are plain text, as vLLM's are (`Success: LoRA adapter 'x' added successfully.`);
errors are OpenAI error bodies.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from app.adapters import (
    AdapterError,
    AdapterRegistry,
    RegisteredAdapter,
    check_adapter_name,
    validate_adapter_dir,
)
from app.fleet import FleetClient, ReplicaReply
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
    ) -> None:
        self.fleet = fleet
        self.runtime_adapter_dirs = tuple(runtime_adapter_dirs)  # empty: loading is off
        self.registry = registry
        self.report_timeout_s = report_timeout_s
        self._lock = asyncio.Lock()
        self._ranks: dict[Path, int | None] = {}  # from adapter_config.json, by folder

    # -- load / unload -----------------------------------------------------------------------

    async def load(self, body: LoadLoraAdapterRequest) -> str:
        name = body.lora_name
        if not self.runtime_adapter_dirs:
            raise APIError(LOADING_OFF_MESSAGE, 403, param="lora_path")
        try:
            check_adapter_name(name, self.registry.base_name)
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_name") from e
        try:  # absolute and resolved: replicas do not share our cwd
            path = await asyncio.to_thread(
                resolve_runtime_adapter_path, body.lora_path, self.runtime_adapter_dirs
            )
        except PathRefused as e:
            raise APIError(str(e), 400, param="lora_path") from e
        try:
            info = await asyncio.to_thread(validate_adapter_dir, path, self.registry.max_lora_rank)
        except AdapterError as e:
            raise APIError(f"cannot load adapter {name!r}: {e}", e.status, param="lora_path") from e
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
                raise _fleet_error(f"could not load adapter {name!r}", replies, failed)
            self.registry.add(name, path)
            self._ranks[path] = info.rank
        logger.info("loaded adapter %s from %s on %d replica(s)", name, path, len(replies))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _undo_load(self, name: str, load_id: str) -> None:
        replies = await self.fleet.broadcast_unload_adapter(name, load_id)
        stuck = [r for r in replies if not r.ok and r.status != 404]
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
            raise not_found from None
        async with self._lock:
            replies = await self.fleet.broadcast_unload_adapter(name)
            if not replies:
                raise APIError("no engine replica is running", 503)
            done = [r for r in replies if r.ok]
            failed = [r for r in replies if not r.ok and r.status != 404]
            if done or not failed:
                # Gone from (at least part of) the fleet: this ingress stops sending it now.
                self.registry.remove(name)
            if failed:
                raise _fleet_error(f"could not unload adapter {name!r}", replies, failed)
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
                tier = "disk" if source == "adapter_root" else "absent"
                placements.append(AdapterPlacement(replica_id=replica_id, tier=tier))
        rank = next((s["rank"] for s in known if s.get("rank") is not None), None)
        if rank is None and path is not None:
            rank = await self._config_rank(Path(path))
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


def _replica_state(reply: ReplicaReply) -> ReplicaState:
    if not reply.ok:
        logger.warning("engine replica %s did not report: %s", reply.replica_id, reply.detail)
        return ReplicaState(replica_id=reply.replica_id, available=False, error=reply.reason)
    if reply.value.get("adapters") is None:
        error = reply.value.get("error") or "no answer from its engine"
        return ReplicaState(replica_id=reply.replica_id, available=False, error=error)
    return ReplicaState(replica_id=reply.replica_id, available=True)


def _fleet_error(what: str, replies: list[ReplicaReply], failed: list[ReplicaReply]) -> APIError:
    """One error for a broadcast that failed on some replicas: the replicas' own status when they
    all refused alike (400 bad adapter or name in use, 404), else 503."""
    logger.warning("%s on %d of %d engine replica(s): %s", what, len(failed), len(replies),
                   failed[0].detail)  # fmt: skip
    statuses = {r.status for r in failed}
    status = statuses.pop() if len(statuses) == 1 and None not in statuses else 503
    message = f"{what} on {len(failed)} of {len(replies)} engine replica(s): {failed[0].reason}"
    return APIError(message, status)
