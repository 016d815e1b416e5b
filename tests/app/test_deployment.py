"""The engine deployment class without a Ray cluster: a real small engine on CPU, metrics into a
recording backend, and the control-plane methods the ingress broadcasts."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.config import EngineConfig
from replicas.deployment import EngineDeployment, EngineMetrics
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind
from replicas.protocol import GenerateRequest
from replicas.request import SamplingParams
from tests.app.conftest import FakeMetricsBackend
from tests.factories import make_adapter, make_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("deployment")
    model = make_model(root / "model")
    adapter = make_adapter(model, root / "sql", rank=4, target_modules=["q_proj", "v_proj"])
    return model, adapter


@pytest.fixture
async def replica(files):
    """A deployment built inside the event loop, as Serve builds it: its stats task runs."""
    model, _ = files
    backend = FakeMetricsBackend()
    config = EngineConfig(
        model=str(model), num_kv_blocks=64, block_size=4, max_lora_rank=8, max_loras_per_batch=2
    )
    deployment = EngineDeployment.func_or_class(
        config, metrics=EngineMetrics(backend), stats_period_s=0.01
    )
    yield deployment, backend
    deployment.__del__()  # what Serve's teardown runs: stops the stats task and the engine


async def generate(deployment, request_id: str, adapter: str | None = None):
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request = GenerateRequest(request_id, [5, 17, 200], sampling, adapter)
    return [chunk async for chunk in deployment.generate(request)]


async def until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds. The deadline only turns a hang into a failure: what is
    waited for is bound to happen (the stats task runs every 10 ms), so it is generous."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class TestMetrics:
    async def test_each_finished_request_is_observed(self, replica, files):
        deployment, backend = replica
        await deployment.load_adapter("sql", str(files[1]))
        base = await generate(deployment, "base")
        with_adapter = await generate(deployment, "with-adapter", "sql")
        assert base[-1].finish_reason == with_adapter[-1].finish_reason == "length"
        queue = backend["lorafleet_queue_seconds"]
        assert len(queue.values(model_kind="base")) == len(queue.values(model_kind="adapter")) == 1
        assert len(backend["lorafleet_adapter_wait_seconds"].records) == 1
        assert all(v >= 0 for v, _ in queue.records)

    async def test_the_stats_task_turns_stats_into_metrics(self, replica, files):
        deployment, backend = replica
        await deployment.load_adapter("sql", str(files[1]))
        await generate(deployment, "r1", "sql")
        steps = backend["lorafleet_engine_steps"]
        loads = backend["lorafleet_adapter_loads"]
        await until(lambda: steps.total() >= 3 and loads.total(tier="gpu") >= 1)
        assert loads.total(tier="host") == 1
        assert len(backend["lorafleet_adapter_load_seconds"].records) == 1
        assert backend["lorafleet_adapter_slots"].values() == [2]
        assert backend["lorafleet_kv_blocks"].records[-1][0] == 64
        assert backend["lorafleet_engine_running_requests"].records[-1][0] == 0

    async def test_stats_keep_the_keys_and_types_that_metrics_and_tools_read(self, replica, files):
        deployment, _ = replica
        await deployment.load_adapter("sql", str(files[1]))
        await generate(deployment, "r1", "sql")
        stats = await deployment.stats()
        assert set(stats) == {
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
            "num_aborted",
            "num_abandoned",
            "abandoned_at",
            "num_held_slots",
            "step_cpu_s",
            "callers",
            "caller_done_at",
        }
        assert isinstance(stats["adapter_read_seconds"], list)
        assert len(stats["adapter_read_seconds"]) == stats["adapter_disk_reads"] == 1
        assert stats["resident_adapters"] == {"sql": 0}
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 64
        assert stats["adapter_gpu_loads"] == stats["adapter_hits"] + stats["adapter_misses"] == 1
        assert stats["num_steps"] == 3 and stats["num_running"] == stats["num_waiting"] == 0
        assert stats["num_finished"] == 1 and stats["busy_s"] > 0
        assert 0 < stats["step_cpu_s"] and stats["callers"] == {} == stats["caller_done_at"]

    async def test_each_callers_live_requests_and_when_its_last_one_ended(self, replica):
        deployment, _ = replica
        sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        stream = deployment.generate(GenerateRequest("r1", [5, 17], sampling), caller="ingress-a")
        await anext(stream)
        stats = await deployment.stats()
        assert stats["callers"] == {"ingress-a": 1} and stats["caller_done_at"] == {}
        before = time.time()
        async for _ in stream:
            pass
        stats = await deployment.stats()
        assert stats["callers"] == {}
        assert before <= stats["caller_done_at"]["ingress-a"] <= time.time()

    async def test_replica_stats_are_the_stats_with_the_replicas_id(self, replica):
        deployment, _ = replica
        stats = await deployment.replica_stats()
        assert stats.pop("replica_id") == "local"
        assert set(stats) == set(await deployment.stats())

    async def test_info_gives_what_the_ingress_checks_requests_against(self, replica):
        deployment, _ = replica
        info = await deployment.info()
        assert set(info) == {"max_model_len", "eos_token_ids", "vocab_size"}
        assert isinstance(info["eos_token_ids"], list) and info["vocab_size"] > 0


class TestControlPlane:
    async def test_undoing_a_load_touches_only_that_load(self, replica, files):
        deployment, _ = replica
        await deployment.load_adapter("sql", str(files[1]), False, "load-1")
        with pytest.raises(RequestRejected) as e:
            await deployment.unload_adapter("sql", "load-2")
        assert e.value.kind is ErrorKind.NOT_FOUND
        assert "sql" in (await deployment.served_adapters())["adapters"]
        await deployment.unload_adapter("sql", "load-1")
        served = await deployment.served_adapters()
        assert "sql" not in served["adapters"] and "sql" in served["unloaded"]

    async def test_unknown_adapter_unload_is_404(self, replica):
        deployment, _ = replica
        with pytest.raises(RequestRejected) as e:
            await deployment.unload_adapter("nope")
        assert e.value.kind is ErrorKind.NOT_FOUND

    async def test_adapter_report_names_the_replica(self, replica, files):
        deployment, _ = replica
        await deployment.load_adapter("sql", str(files[1]), True)
        report = await deployment.adapter_report(60.0)  # an idle engine answers at once
        assert report["replica_id"] == "local" and report["error"] is None
        assert report["adapters"]["sql"]["pinned"] is True
        assert report["adapters"]["sql"]["tier"] in {"gpu", "loading", "host", "disk"}


class TestRuntimeAdaptersOutliveReplicas:
    async def test_a_replica_that_starts_later_serves_the_fleets_adapters(self, files):
        from replicas.adapter_ledger import AdapterEntry, MemoryLedger

        model, sql = files
        config = EngineConfig(
            model=str(model),
            num_kv_blocks=64,
            block_size=4,
            max_lora_rank=8,
            adapters=(("configured", str(sql)),),
        )
        ledger = MemoryLedger()
        ledger.write(AdapterEntry("runtime", str(sql), 10, load_id="l1"))
        ledger.write(AdapterEntry("configured", None, 11))  # unloaded at run time
        replica = EngineDeployment.func_or_class(
            config, metrics=EngineMetrics(FakeMetricsBackend()), ledger=ledger
        )
        try:
            served = await replica.served_adapters()
            assert served["adapters"] == {"runtime": str(sql)}
            assert "configured" in served["unloaded"]
            chunks = await generate(replica, "r1", "runtime")
            assert chunks[-1].finish_reason == "length"
            # A later unload, then a catch-up that reads the older load: the unload stands.
            await replica.unload_adapter("runtime", None, 12)
            await replica.unload_adapter("runtime", None, 12)  # the same unload again: done
            assert await replica.sync_adapters() == []
            assert "runtime" not in (await replica.served_adapters())["adapters"]
            # A load written to the ledger after this replica started arrives on the next one.
            ledger.write(AdapterEntry("late", str(sql), 13))
            assert await replica.sync_adapters() == ["late"]
            assert (await replica.served_adapters())["adapters"] == {"late": str(sql)}
        finally:
            replica.__del__()
