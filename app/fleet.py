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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from app.adapters import FleetView

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

# Time a broadcast may take beyond what the replicas are asked to bound themselves to.
BROADCAST_GRACE_S = 2.0
CONTROL_TIMEOUT_S = 30.0  # load/unload: the engine only checks the folder's config


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
    def status(self) -> int | None:
        """The HTTP status an engine refusal carries (`RequestRejected.status`), else None."""
        return getattr(self.error, "status", None) if self.error is not None else None

    @property
    def reason(self) -> str:
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


class ServeFleetClient:
    """`FleetClient` over a handle to the engine deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def served_adapters(self) -> FleetView:
        answer = await self._handle.served_adapters.remote()
        return FleetView(dict(answer["adapters"]), frozenset(answer["unloaded"]))

    async def broadcast_load_adapter(
        self, name: str, path: str, pinned: bool, load_id: str
    ) -> list[ReplicaReply]:
        return await self._broadcast(
            CONTROL_TIMEOUT_S, "load_adapter", name, path, pinned, load_id
        )

    async def broadcast_unload_adapter(
        self, name: str, load_id: str | None = None
    ) -> list[ReplicaReply]:
        return await self._broadcast(CONTROL_TIMEOUT_S, "unload_adapter", name, load_id)

    async def adapter_reports(self, timeout_s: float) -> list[ReplicaReply]:
        replies = await self._broadcast(
            timeout_s + BROADCAST_GRACE_S, "adapter_report", timeout_s
        )
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
