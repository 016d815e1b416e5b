"""Metrics observed through a recording backend: the ingress's per-request timings and counts,
and the engine replica's gauges, counter growth and per-request waits."""

from __future__ import annotations

import itertools

import pytest

from app.metrics import TOKEN_COUNT_PERIOD_S, IngressMetrics
from replicas.deployment import EngineMetrics
from replicas.engine_stats import EngineStats
from replicas.errors import ErrorKind
from replicas.protocol import EngineError
from tests.app.conftest import BASE, FakeEngine, FakeMetricsBackend, make_client, text_chunks


def stepping_clock(step: float = 0.5):
    """A clock that moves `step` seconds each time it is read."""
    ticks = itertools.count()
    return lambda: next(ticks) * step


class TestIngressMetrics:
    async def test_streamed_request_timings_and_tokens(self, tokenizer, known_adapter):
        backend = FakeMetricsBackend()
        metrics = IngressMetrics(backend, clock=stepping_clock())
        engine = FakeEngine(text_chunks("Hel", "lo", "!"))
        async with make_client(
            engine, tokenizer, adapters={"sql": str(known_adapter)}, metrics=metrics
        ) as client:
            r = await client.post(
                "/v1/completions", json={"model": "sql", "prompt": "abcd", "stream": True}
            )
        assert r.status_code == 200
        adapter = {"model_kind": "adapter"}
        # Clock reads: arrival 0, first chunk 0.5, then 1.0 and 1.5, finish 2.0.
        assert backend["lorafleet_time_to_first_token_seconds"].records == [(0.5, adapter)]
        # "lo" (2 tokens, 0.5 s after "Hel") comes a period after the arrival: its gaps are
        # observed then; "!" (1 token, 0.5 s later) when the request closes.
        assert backend["lorafleet_inter_token_latency_seconds"].values() == [0.25, 0.5]
        assert backend["lorafleet_request_latency_seconds"].records == [(2.0, adapter)]
        assert backend["lorafleet_output_tokens"].total(model_kind="adapter") == 6
        assert backend["lorafleet_prompt_tokens"].total(model_kind="adapter") == 4
        assert backend["lorafleet_requests"].records == [
            (1, {"route": "/v1/completions", "status": "200"})
        ]

    def test_output_tokens_and_gaps_are_counted_a_period_at_a_time_and_at_close(self):
        backend = FakeMetricsBackend()
        now = [0.0]
        metrics = IngressMetrics(backend, clock=lambda: now[0])
        timer = metrics.generation("sql", arrival=0.0)
        counted = backend["lorafleet_output_tokens"]
        for i in range(1, 10):  # chunks of 2 tokens every 0.1 s: under a period, none counted
            now[0] = i * TOKEN_COUNT_PERIOD_S / 10
            timer.tokens(2)
        assert counted.records == []
        now[0] = TOKEN_COUNT_PERIOD_S
        timer.tokens(2)  # a period since the request arrived: its 20 tokens at once
        assert counted.records == [(20, {"model_kind": "adapter"})]
        now[0] += TOKEN_COUNT_PERIOD_S / 5
        timer.tokens(3)
        timer.close()  # the request ends (however it ends): the rest is counted
        timer.close()  # again (a stop string closes it, then the response does): nothing more
        assert counted.values() == [20, 3]
        # The token gaps too: the first chunk (0.1 s) starts them; 18 tokens over the next
        # 0.9 s at the period's end, then 3 over 0.2 s at close.
        gaps = backend["lorafleet_inter_token_latency_seconds"].values()
        assert gaps == pytest.approx([0.9 / 18, 0.2 / 3])

    async def test_requests_are_counted_by_route_and_status(self, tokenizer):
        backend = FakeMetricsBackend()
        refused = FakeEngine(error=EngineError("overloaded", ErrorKind.UNAVAILABLE))
        async with make_client(refused, tokenizer, metrics=IngressMetrics(backend)) as client:
            await client.post("/v1/completions", json={"model": BASE, "prompt": "a"})
            await client.post("/v1/completions", json={"model": "nope", "prompt": "a"})
            await client.post("/v1/chat/completions", json={"model": BASE})
            await client.get("/v1/models")
            await client.get("/no/such/route")
        counted = backend["lorafleet_requests"]
        assert [tags for _, tags in counted.records] == [
            {"route": "/v1/completions", "status": "503"},
            {"route": "/v1/completions", "status": "404"},
            {"route": "/v1/chat/completions", "status": "400"},
            {"route": "/v1/models", "status": "200"},
            {"route": "other", "status": "404"},
        ]
        # A refused request generated nothing.
        assert backend["lorafleet_time_to_first_token_seconds"].records == []

    async def test_base_requests_are_told_apart_from_adapter_requests(self, tokenizer):
        backend = FakeMetricsBackend()
        async with make_client(
            FakeEngine(text_chunks("ab")), tokenizer, metrics=IngressMetrics(backend)
        ) as client:
            await client.post("/v1/completions", json={"model": BASE, "prompt": "a"})
        assert backend["lorafleet_output_tokens"].records == [(2, {"model_kind": "base"})]

    async def test_a_stop_string_finishes_the_request(self, tokenizer):
        backend = FakeMetricsBackend()
        engine = FakeEngine(text_chunks("ab", "cd"), finish_reason="stop")
        async with make_client(engine, tokenizer, metrics=IngressMetrics(backend)) as client:
            await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stop": ["b"]}
            )
        # Stopped by a stop string: finished from the client's view, engine aborted.
        assert len(backend["lorafleet_request_latency_seconds"].records) == 1
        assert backend["lorafleet_output_tokens"].total() == 2


def engine_stats(**overrides) -> EngineStats:
    stats = {
        "num_steps": 0,
        "num_preemptions": 0,
        "max_adapters_in_step": 0,
        "adapter_disk_reads": 0,
        "adapter_gpu_loads": 0,
        "adapter_prefetch_loads": 0,
        "adapter_hits": 0,
        "adapter_misses": 0,
        "adapter_read_seconds": (),
        "resident_adapters": {},
        "num_free_kv_blocks": 100,
        "num_kv_blocks": 100,
        "num_running": 0,
        "num_waiting": 0,
    }
    return EngineStats(**{**stats, **overrides})


class TestEngineMetrics:
    def test_gauges_follow_the_latest_stats(self):
        backend = FakeMetricsBackend()
        metrics = EngineMetrics(backend)
        metrics.set_slot_capacity(8)
        metrics.update(engine_stats(num_running=3, num_waiting=5, num_free_kv_blocks=40,
                                    resident_adapters={"a": 0, "b": 1}))
        metrics.update(engine_stats(num_running=1, num_waiting=0, resident_adapters={"a": 0}))
        last = {name: m.records[-1][0] for name, m in backend.metrics.items() if m.records}
        assert last["lorafleet_engine_running_requests"] == 1
        assert last["lorafleet_engine_waiting_requests"] == 0
        assert last["lorafleet_adapter_slots_used"] == 1
        assert last["lorafleet_adapter_slots"] == 8
        assert last["lorafleet_kv_blocks_free"] == 100
        assert last["lorafleet_kv_blocks"] == 100

    def test_counters_grow_by_the_difference(self):
        backend = FakeMetricsBackend()
        metrics = EngineMetrics(backend)
        metrics.update(engine_stats(num_steps=10, adapter_disk_reads=2, adapter_gpu_loads=3,
                                    adapter_hits=4, adapter_misses=3, adapter_prefetch_loads=1))
        metrics.update(engine_stats(num_steps=25, adapter_disk_reads=2, adapter_gpu_loads=5,
                                    adapter_hits=9, adapter_misses=5, adapter_prefetch_loads=1))
        assert backend["lorafleet_engine_steps"].values() == [10, 15]
        assert backend["lorafleet_adapter_loads"].values(tier="host") == [2]
        assert backend["lorafleet_adapter_loads"].values(tier="gpu") == [3, 2]
        assert backend["lorafleet_adapter_prefetch_loads"].values() == [1]
        assert backend["lorafleet_adapter_slot_hits"].total() == 9
        assert backend["lorafleet_adapter_slot_misses"].total() == 5

    def test_only_new_load_latencies_are_observed(self):
        backend = FakeMetricsBackend()
        metrics = EngineMetrics(backend)
        metrics.update(engine_stats(adapter_disk_reads=2, adapter_read_seconds=(0.1, 0.2)))
        metrics.update(engine_stats(adapter_disk_reads=2, adapter_read_seconds=(0.1, 0.2)))
        metrics.update(engine_stats(adapter_disk_reads=3, adapter_read_seconds=(0.1, 0.2, 0.3)))
        # The window keeps only the latest reads: 3 more reads, 2 of them still in the window.
        metrics.update(engine_stats(adapter_disk_reads=6, adapter_read_seconds=(0.5, 0.6)))
        assert backend["lorafleet_adapter_load_seconds"].values() == [0.1, 0.2, 0.3, 0.5, 0.6]

    @pytest.mark.parametrize(("adapter", "kind"), [(True, "adapter"), (False, "base")])
    def test_finished_request_waits(self, adapter, kind):
        backend = FakeMetricsBackend()
        EngineMetrics(backend).request_finished(adapter, {"queue_s": 0.5, "adapter_wait_s": 0.4})
        assert backend["lorafleet_queue_seconds"].records == [(0.5, {"model_kind": kind})]
        waits = backend["lorafleet_adapter_wait_seconds"].values()
        assert waits == ([0.4] if adapter else [])
