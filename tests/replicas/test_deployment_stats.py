"""What an engine replica reports, typed inside it, leaves it as dicts that other processes read
by key (the router, the ingress, benchmarks): those keys and values hold still."""

from __future__ import annotations

import json

from replicas.adapters.registry import ServedAdapters
from replicas.deployment.stats import ReplicaStats, routing_stats_dict, served_adapters_dict
from replicas.engine_stats import EngineStats, RoutingStats
from router.routing import replica_view

ENGINE_KEYS = {  # EngineStats, read by EngineMetrics and benchmarks
    "num_steps",
    "num_preemptions",
    "max_adapters_in_step",
    "adapter_disk_reads",
    "adapter_gpu_loads",
    "adapter_prefetch_loads",
    "adapter_hits",
    "adapter_misses",
    "adapter_read_seconds",
    "resident_adapters",
    "num_free_kv_blocks",
    "num_kv_blocks",
    "num_running",
    "num_waiting",
    "busy_s",
    "launch_s",
    "step_seqs",
    "num_finished",
}
REPLICA_KEYS = {  # read by benchmarks (bench_chaos, serve_http) and the e2e tests
    "num_held_slots",
    "num_aborted",
    "step_cpu_s",
    "callers",
    "caller_done_at",
    "num_abandoned",
    "abandoned_at",
}


def replica_stats(**overrides) -> ReplicaStats:
    engine = EngineStats(
        num_steps=7,
        num_preemptions=1,
        max_adapters_in_step=2,
        adapter_disk_reads=2,
        adapter_gpu_loads=3,
        adapter_prefetch_loads=1,
        adapter_hits=2,
        adapter_misses=1,
        adapter_read_seconds=(0.1, 0.2),
        resident_adapters={"sql": 0},
        num_free_kv_blocks=60,
        num_kv_blocks=64,
        num_running=1,
        num_waiting=2,
        busy_s=0.5,
        launch_s=0.1,
        step_seqs=9,
        num_finished=4,
    )
    fields = {
        "engine": engine,
        "num_held_slots": 1,
        "num_aborted": 3,
        "step_cpu_s": 0.25,
        "callers": {"ingress-a": 1},
        "caller_done_at": {"ingress-b": 1.5e9},
        "num_abandoned": 1,
        "abandoned_at": 1.6e9,
    }
    return ReplicaStats(**{**fields, **overrides})


class TestReplicaStats:
    def test_the_engines_fields_sit_at_the_top_beside_the_replicas(self):
        wire = replica_stats().to_dict()
        assert set(wire) == ENGINE_KEYS | REPLICA_KEYS
        assert list(wire)[: len(ENGINE_KEYS)] == list(EngineStats.__dataclass_fields__)
        assert wire["num_steps"] == 7 and wire["resident_adapters"] == {"sql": 0}
        assert wire["num_held_slots"] == 1 and wire["num_aborted"] == 3
        assert wire["callers"] == {"ingress-a": 1}
        assert wire["caller_done_at"] == {"ingress-b": 1.5e9}
        assert wire["num_abandoned"] == 1 and wire["abandoned_at"] == 1.6e9

    def test_values_are_plain_json(self):
        wire = replica_stats(abandoned_at=None).to_dict()
        assert wire["adapter_read_seconds"] == [0.1, 0.2]  # a list, as JSON reads it back
        assert json.loads(json.dumps(wire)) == wire

    def test_the_dict_is_a_copy(self):
        stats = replica_stats()
        wire = stats.to_dict()
        wire["callers"]["ingress-c"] = 1
        wire["resident_adapters"]["other"] = 1
        assert stats.callers == {"ingress-a": 1}
        assert stats.engine.resident_adapters == {"sql": 0}


class TestRoutingStats:
    def test_keys_and_lists_the_router_reads(self):
        stats = RoutingStats(
            gpu=("a",), loading=("b",), host=("c", "d"), num_slots=4, free_slots=2,
            num_waiting=3, num_running=1,
        )  # fmt: skip
        wire = routing_stats_dict(stats)
        assert wire == {
            "gpu": ["a"],
            "loading": ["b"],
            "host": ["c", "d"],
            "num_slots": 4,
            "free_slots": 2,
            "num_waiting": 3,
            "num_running": 1,
        }
        view = replica_view("r0", wire)
        assert "a" in view.gpu and view.free_slots == 2 and view.num_slots == 4
        assert view.queue_len == 4


class TestServedAdapters:
    def test_names_and_paths_then_the_unloaded_names(self):
        served = ServedAdapters({"sql": "/adapters/sql"}, ("old",))
        assert served_adapters_dict(served) == {
            "adapters": {"sql": "/adapters/sql"},
            "unloaded": ["old"],
        }
