"""What an engine replica reports, typed inside the replica and turned into plain dicts only
where they leave it: the answers of `EngineDeployment.stats`, `record_routing_stats` and
`served_adapters`, read by key in other processes (the router, the ingress, benchmarks). Their
keys and values are a wire format: `tests/replicas/test_deployment_stats.py` holds them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from replicas.adapters.registry import ServedAdapters
from replicas.engine_stats import EngineStats, RoutingStats


@dataclass(frozen=True)
class ReplicaStats:
    """The engine's `EngineStats` and what the replica around it counts."""

    engine: EngineStats
    num_held_slots: int  # GPU slots held by requests
    num_aborted: int  # live requests aborted: the caller closed the stream, or went away
    step_cpu_s: float  # the engine loop's thread CPU time inside steps (wherever it runs)
    callers: dict[str, int]  # caller -> its live requests here
    caller_done_at: dict[str, float]  # caller -> when its last request here ended (wall clock)
    num_abandoned: int  # requests aborted because their caller's lease lapsed
    abandoned_at: float | None  # when the last of them was (wall clock)

    def to_dict(self) -> dict[str, Any]:
        """The engine's fields at the top level, beside the replica's."""
        return {
            **asdict(self.engine),
            "adapter_read_seconds": list(self.engine.adapter_read_seconds),
            "num_held_slots": self.num_held_slots,
            "num_aborted": self.num_aborted,
            "step_cpu_s": self.step_cpu_s,
            "callers": dict(self.callers),
            "caller_done_at": dict(self.caller_done_at),
            "num_abandoned": self.num_abandoned,
            "abandoned_at": self.abandoned_at,
        }


def routing_stats_dict(stats: RoutingStats) -> dict[str, Any]:
    """`{"gpu", "loading", "host": [adapter], "num_slots", "free_slots", "num_waiting",
    "num_running"}`, as the router reads it (`router.routing.replica_view`)."""
    return {
        "gpu": list(stats.gpu),
        "loading": list(stats.loading),
        "host": list(stats.host),
        "num_slots": stats.num_slots,
        "free_slots": stats.free_slots,
        "num_waiting": stats.num_waiting,
        "num_running": stats.num_running,
    }


def served_adapters_dict(served: ServedAdapters) -> dict[str, Any]:
    """`{"adapters": {name: path}, "unloaded": [name]}`."""
    return {"adapters": dict(served.adapters), "unloaded": list(served.unloaded)}
