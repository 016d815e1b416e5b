"""The engine replica's metrics, exported through `ray.serve.metrics`."""

from __future__ import annotations

from typing import Any

from replicas.deployment import ray_runtime
from replicas.engine_stats import EngineStats

WAIT_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LOAD_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class EngineMetrics:
    """The replica's metrics, exported through `ray.serve.metrics` (Serve adds the deployment,
    replica and application tags). `backend` is `ray.serve.metrics` or anything with its
    `Counter`, `Gauge` and `Histogram` constructors (tests pass a recording fake).

    `update(stats)` sets the gauges from an `EngineStats` snapshot and adds the counters' growth
    since the previous one; `request_finished` observes a finished request's waits. No
    adapter-name tags: names are unbounded.
    """

    def __init__(self, backend: Any = None) -> None:
        m = backend if backend is not None else ray_runtime.serve_metrics()
        self.running = m.Gauge(
            "lorafleet_engine_running_requests", description="Requests running in the engine."
        )
        self.waiting = m.Gauge(
            "lorafleet_engine_waiting_requests",
            description="Requests queued in the engine, waiting to be admitted.",
        )
        self.slots_used = m.Gauge(
            "lorafleet_adapter_slots_used",
            description="GPU adapter slots holding an adapter (loaded or loading).",
        )
        self.slots_total = m.Gauge(
            "lorafleet_adapter_slots", description="GPU adapter slots (max_loras_per_batch)."
        )
        self.kv_blocks_free = m.Gauge(
            "lorafleet_kv_blocks_free", description="Free KV cache blocks."
        )
        self.kv_blocks_total = m.Gauge("lorafleet_kv_blocks", description="KV cache blocks.")
        self.steps = m.Counter("lorafleet_engine_steps", description="Engine steps run.")
        self.loads = m.Counter(
            "lorafleet_adapter_loads",
            description=(
                "Adapter loads by the tier loaded into: host (read from disk) or gpu (copied "
                "into a GPU slot)."
            ),
            tag_keys=("tier",),
        )
        self.prefetch_loads = m.Counter(
            "lorafleet_adapter_prefetch_loads",
            description="GPU slot loads the prefetcher started ahead of a request's admission.",
        )
        self.slot_hits = m.Counter(
            "lorafleet_adapter_slot_hits",
            description="Admissions that found their adapter already in a GPU slot.",
        )
        self.slot_misses = m.Counter(
            "lorafleet_adapter_slot_misses",
            description="Admissions that had to bring their adapter into a GPU slot.",
        )
        self.load_latency = m.Histogram(
            "lorafleet_adapter_load_seconds",
            description="Time to read an adapter from disk into host memory.",
            boundaries=LOAD_BUCKETS_S,
        )
        self.adapter_wait = m.Histogram(
            "lorafleet_adapter_wait_seconds",
            description="Time an adapter request waited for its adapter to reach a GPU slot.",
            boundaries=WAIT_BUCKETS_S,
        )
        self.queue_time = m.Histogram(
            "lorafleet_queue_seconds",
            description="Time a request waited in the engine's queue before admission.",
            boundaries=WAIT_BUCKETS_S,
            tag_keys=("model_kind",),
        )
        # Counters that follow the engine's running totals.
        self._steps = _Growth(self.steps)
        self._disk_reads = _Growth(self.loads, {"tier": "host"})
        self._gpu_loads = _Growth(self.loads, {"tier": "gpu"})
        self._prefetch_loads = _Growth(self.prefetch_loads)
        self._hits = _Growth(self.slot_hits)
        self._misses = _Growth(self.slot_misses)

    def set_slot_capacity(self, num_slots: int) -> None:
        self.slots_total.set(num_slots)

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.slots_used.set(len(stats.resident_adapters))
        self.kv_blocks_free.set(stats.num_free_kv_blocks)
        self.kv_blocks_total.set(stats.num_kv_blocks)
        self._steps.follow(stats.num_steps)
        reads = self._disk_reads.follow(stats.adapter_disk_reads)
        self._gpu_loads.follow(stats.adapter_gpu_loads)
        self._prefetch_loads.follow(stats.adapter_prefetch_loads)
        self._hits.follow(stats.adapter_hits)
        self._misses.follow(stats.adapter_misses)
        # `adapter_read_seconds` is a window of the latest disk-read latencies, one per read
        # (reads in blocking mode are counted but not timed, so they add none).
        window = stats.adapter_read_seconds
        for seconds in window[len(window) - min(reads, len(window)) :]:
            self.load_latency.observe(seconds)

    def request_finished(self, adapter: bool, metrics: dict[str, float]) -> None:
        kind = "adapter" if adapter else "base"
        self.queue_time.observe(metrics.get("queue_s", 0.0), tags={"model_kind": kind})
        if adapter:
            self.adapter_wait.observe(metrics.get("adapter_wait_s", 0.0))


class _Growth:
    """A counter following one of the engine's running totals: each reading adds the growth
    since the previous one. A total that went back was reset: all of it is growth."""

    def __init__(self, counter: Any, tags: dict[str, str] | None = None) -> None:
        self.counter = counter
        self.tags = tags
        self.seen = 0

    def follow(self, total: int) -> int:
        """Add the growth to the counter; returns it."""
        grown = total - self.seen
        self.seen = total
        grown = grown if grown >= 0 else total
        if grown > 0:
            self.counter.inc(grown, tags=self.tags)
        return grown
