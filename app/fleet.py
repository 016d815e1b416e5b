"""Control-plane calls that reach every engine replica.

Serve's `DeploymentHandle.broadcast(method, *args)` (Ray 2.60, alpha API) sends one call to each
replica the caller's router knows as running, and `results_async(return_exceptions=True)` returns
one answer or exception per replica. Two limits shape what is built on it here:

- Answers come back in no particular order and without the replica's id, and a call cannot be
  aimed at one replica. So a replica names itself in its answer when the id matters
  (`adapter_report`), and undoing a partial load is itself a broadcast that only the replicas
  where that load landed act on (`load_id`, see `EngineDeployment.unload_adapter`).
- The timeout covers the whole collection: when it runs out, every answer is lost. So a replica
  bounds its own wait on its engine (`adapter_report(timeout_s)`) and answers in time; only a
  replica whose process is stuck costs the whole listing.

A replica that Serve skips at send time (dead, or unreachable at that moment) gives no answer at
all; one that starts later does not receive the call.

Loads and unloads are also written to the fleet's adapter ledger (`replicas/adapter_ledger.py`,
in Ray's GCS store), which engine replicas that start later read, so runtime adapters survive
restarts and reach new replicas: a load once every replica took it, an unload before it is
sent (and put back when no replica acted on it).

Generation goes through the same handle under the caller's id (`caller_id`: this ingress's
Ray actor id). No call renews anything: an engine replica asks Ray's GCS whether a caller whose
requests it runs is still alive, and aborts them when it is dead (see `replicas/leases.py`). A
renewal sent as a Serve call would queue behind the very requests it is meant to protect: at
`max_ongoing_requests` it waits, lapses, and the live requests are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from app.adapters import FleetView
from replicas.adapter_ledger import AdapterEntry, LedgerStore
from replicas.errors import ErrorKind, ServingError

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

# Time a broadcast may take beyond what the replicas are asked to bound themselves to.
BROADCAST_GRACE_S = 2.0
CONTROL_TIMEOUT_S = 30.0  # load/unload: the engine only checks the folder's config
REPLICA_FAILED = "the engine replica failed or is unavailable"
REPLICA_TIMED_OUT = "the engine replicas did not answer in time"

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReplicaReply:
    """One replica's answer to a broadcast: `value`, or `error` when the call failed.
    `replica_id` is known only when the replica named itself in its answer."""

    replica_id: str | None = None
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def kind(self) -> ErrorKind | None:
        """The kind of an engine refusal (a `RequestRejected`, which Ray's wrapper of it still
        is), else None."""
        return self.error.kind if isinstance(self.error, ServingError) else None

    @property
    def reason(self) -> str:
        """What a client may read of the failure: an engine refusal's own message (it carries a
        `kind`), else a fixed text. Ray's errors name actors, process ids, hosts and classes:
        those stay in `detail`, for the log."""
        if self.kind is not None:
            return self.detail
        if isinstance(self.error, TimeoutError):
            return REPLICA_TIMED_OUT
        return REPLICA_FAILED

    @property
    def detail(self) -> str:
        """The error's own message (a replica's exception arrives wrapped in Ray's
        RayTaskError, whose text is the whole remote traceback)."""
        error = getattr(self.error, "cause", None) or self.error
        return str(error) or type(error).__name__


class FleetClient(Protocol):
    """The engine fleet's control plane, as the ingress sees it.

    `served_adapters` asks one replica. The broadcasts return one `ReplicaReply` per replica that
    answered (an empty list when no replica is running); a broadcast that timed out as a whole
    returns a single reply with a `TimeoutError` and no replica id.
    """

    async def served_adapters(self) -> FleetView: ...

    async def broadcast_load_adapter(
        self, name: str, path: str, pinned: bool, load_id: str
    ) -> list[ReplicaReply]: ...

    async def broadcast_unload_adapter(
        self, name: str, load_id: str | None = None
    ) -> list[ReplicaReply]: ...

    async def adapter_reports(self, timeout_s: float) -> list[ReplicaReply]:
        """Each replica's `{"replica_id": str, "adapters": {name: status} | None, "error":
        str | None}` (`adapters` None when its engine did not answer within `timeout_s`)."""
        ...


def caller_id() -> str | None:
    """This process's Ray actor id (an ingress replica is an actor), which engine replicas check
    for liveness; None outside an actor (no lease: the request runs until it ends)."""
    try:
        import ray

        if not ray.is_initialized():  # asking would start a local cluster to say "none"
            return None
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # no Ray here
        return None


class ServeFleetClient:
    """`FleetClient` over a handle to the engine deployment."""

    def __init__(self, handle: DeploymentHandle, *, ledger: LedgerStore | None = None) -> None:
        self._handle = handle
        self.caller_id = caller_id()
        self._ledger = ledger

    @property
    def ledger(self) -> LedgerStore:
        if self._ledger is None:
            from replicas.deployment import RayLedger

            self._ledger = RayLedger(self._handle.app_name, self._handle.deployment_name)
        return self._ledger

    async def served_adapters(self) -> FleetView:
        """The fleet's word on adapters changed at run time, from the ledger (every replica
        converges on it; any one replica may be behind a change another ingress made), with an
        engine replica's view beneath it (configured and adapter_root names, and its word when
        the ledger cannot be read)."""
        answer = await self._handle.served_adapters.remote()
        adapters, unloaded = dict(answer["adapters"]), set(answer["unloaded"])
        try:
            entries = await asyncio.to_thread(self.ledger.read_all)
        except Exception as e:
            logger.warning("could not read the adapter ledger: %r", e)
            entries = {}
        for name, entry in entries.items():
            if entry.unloaded:
                adapters.pop(name, None)
                unloaded.add(name)
            else:
                adapters[name] = entry.path
                unloaded.discard(name)
        return FleetView(adapters, frozenset(unloaded))

    async def broadcast_load_adapter(
        self, name: str, path: str, pinned: bool, load_id: str
    ) -> list[ReplicaReply]:
        version = time.time_ns()
        replies = await self._broadcast(
            CONTROL_TIMEOUT_S, "load_adapter", name, path, pinned, load_id, version
        )
        if replies and all(r.ok for r in replies):
            await self._record(AdapterEntry(name, path, version, pinned, load_id))
        return replies

    async def broadcast_unload_adapter(
        self, name: str, load_id: str | None = None
    ) -> list[ReplicaReply]:
        if load_id is not None:  # undoing a partial load: it was never recorded
            return await self._broadcast(CONTROL_TIMEOUT_S, "unload_adapter", name, load_id)
        tombstone = AdapterEntry(name, None, time.time_ns())
        await self._record(tombstone)
        replies = await self._broadcast(
            CONTROL_TIMEOUT_S, "unload_adapter", name, None, tombstone.version
        )
        if not any(r.ok for r in replies):  # nothing was unloaded: the ledger's word stands
            try:
                await asyncio.to_thread(self.ledger.retract, tombstone)
            except Exception:
                logger.exception("could not take back the unload of %s in the ledger", name)
        return replies

    async def _record(self, entry: AdapterEntry) -> None:
        """Add `entry` to the ledger (hidden there if a newer change of its name is in: the
        replicas ignore it too). A ledger that fails is logged: the change holds on the running
        replicas, not on those that start later."""
        try:
            await asyncio.to_thread(self.ledger.write, entry)
        except Exception:
            logger.exception("could not record adapter %s in the ledger", entry.name)

    async def adapter_reports(self, timeout_s: float) -> list[ReplicaReply]:
        replies = await self._broadcast(timeout_s + BROADCAST_GRACE_S, "adapter_report", timeout_s)
        return [
            ReplicaReply(reply.value.get("replica_id"), reply.value)
            if reply.ok and isinstance(reply.value, dict)
            else reply
            for reply in replies
        ]

    async def _broadcast(self, timeout_s: float, method: str, *args: Any) -> list[ReplicaReply]:
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            answers = await self._handle.broadcast(method, *args).results_async(
                timeout_s=timeout_s, return_exceptions=True
            )
        except DeploymentUnavailableError:
            return []
        except TimeoutError as e:
            return [ReplicaReply(error=e)]
        return [
            ReplicaReply(error=a) if isinstance(a, BaseException) else ReplicaReply(value=a)
            for a in answers
        ]
