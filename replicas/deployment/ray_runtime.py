"""Everything an engine replica asks of Ray besides its `@serve.deployment` decorator: its Serve
context, the metrics module, the controller's routing-info message, actors' states in the GCS
and the GCS key-value store. Those marked private are Ray internals with no public equivalent:
what to check when Ray is upgraded."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException


def serve_context() -> Any:
    """Serve's replica context (`replica_id`, `app_name`, `deployment`), or None outside Serve."""
    try:
        return serve.get_replica_context()
    except RayServeException:
        return None


def replica_id() -> str:
    """This replica's id as Serve's metrics and logs name it; "local" outside Serve."""
    context = serve_context()
    return context.replica_id.unique_id if context is not None else "local"


def serve_metrics() -> ModuleType:
    from ray.serve import metrics

    return metrics


def push_routing_info(replica_id: Any, model_ids: list[str], stats: dict[str, Any]) -> None:
    """Private. Send Serve's controller this replica's multiplexed model ids and routing stats,
    the message `@serve.multiplexed` sends for its model ids (Serve has no public call for it;
    the controller passes both on to every router). `replica_id` is the context's `ReplicaID`.
    Fire-and-forget, but fetching the controller client may block the first time."""
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # without a controller it raises instead
    client.record_request_routing_info(
        RequestRoutingInfo(
            replica_id=replica_id, multiplexed_model_ids=model_ids, routing_stats=stats
        )
    )


def actor_state(actor_id: str) -> str | None:
    """Private. The actor's state in Ray's GCS ("ALIVE", "DEAD", ...), None when the table has
    no entry. Blocks."""
    from ray._private import state

    info = state.actors(actor_id=actor_id)
    return info.get("State") if info else None


# Private: the GCS key-value store (`ray.experimental.internal_kv`). Every call blocks.


def kv_list(prefix: str, namespace: str) -> list[bytes]:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_list(prefix, namespace=namespace)


def kv_get(key: bytes | str, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: bytes | str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_del(key: bytes | str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=namespace)
