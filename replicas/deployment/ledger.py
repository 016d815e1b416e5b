"""The fleet's adapter ledger (`replicas.adapter_ledger.LedgerStore`) kept in Ray's GCS."""

from __future__ import annotations

import logging
from typing import Any

from replicas.adapter_ledger import ENTRIES_KEPT, AdapterEntry, newest
from replicas.deployment import ray_runtime

logger = logging.getLogger("ray.serve")

LEDGER_NAMESPACE = "lorafleet"


class RayLedger:
    """The adapter ledger (`LedgerStore`) in Ray's GCS key-value store, which outlives every
    replica: one key per entry, `adapters::<app>::<deployment>::<name>@<version>`, never
    overwritten (the GCS store has no compare-and-set; distinct keys need none). Calls block."""

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self.prefix = f"adapters::{app_name}::{deployment_name}::"

    def _key(self, name: str, version: int) -> str:
        return f"{self.prefix}{name}@{version:020d}"

    def read_all(self) -> dict[str, AdapterEntry]:
        entries: list[AdapterEntry] = []
        for key in ray_runtime.kv_list(self.prefix, LEDGER_NAMESPACE):
            value = ray_runtime.kv_get(key, LEDGER_NAMESPACE)
            if value is None:  # deleted since listed
                continue
            try:
                entries.append(AdapterEntry.from_json(value))
            except (ValueError, TypeError) as e:
                logger.warning("skipping an unreadable ledger entry %r: %s", key, e)
        return newest(entries)

    def write(self, entry: AdapterEntry) -> None:
        ray_runtime.kv_put(self._key(entry.name, entry.version), entry.to_json(), LEDGER_NAMESPACE)
        # Keep the name's newest few. Its own keys: a longer name listed under the same prefix
        # ("x@y" under "x@") leaves a tail that is not all digits.
        own = f"{self.prefix}{entry.name}@"
        keys = []
        for raw in ray_runtime.kv_list(own, LEDGER_NAMESPACE):
            listed = raw.decode() if isinstance(raw, bytes) else raw
            tail = listed[len(own) :]
            if tail.isdigit():
                keys.append((int(tail), listed))
        for _, stale in sorted(keys)[:-ENTRIES_KEPT]:
            ray_runtime.kv_del(stale, LEDGER_NAMESPACE)

    def retract(self, entry: AdapterEntry) -> None:
        ray_runtime.kv_del(self._key(entry.name, entry.version), LEDGER_NAMESPACE)


def fleet_ledger(serve_context: Any) -> RayLedger | None:
    """The ledger of this replica's deployment under Serve; None outside Serve."""
    if serve_context is None:
        return None
    return RayLedger(serve_context.app_name, serve_context.deployment)
