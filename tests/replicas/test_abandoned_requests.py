"""An engine replica aborts the requests of a caller that died, and never those of a live one,
however slow or broken the answer about its liveness (`EngineDeployment.abort_abandoned`, built
without Ray: the liveness check and the clock are injected)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from replicas.config import EngineConfig
from replicas.deployment import EngineDeployment, EngineMetrics, GcsLiveness
from replicas.errors import ErrorKind
from replicas.protocol import GenerateRequest
from replicas.request import SamplingParams
from tests.app.conftest import FakeMetricsBackend
from tests.engines import GatedEngine
from tests.factories import make_model

LEASE_S = 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCluster:
    """What Ray's GCS says of each caller: dead ones are named; `answer_s` is how long each
    answer takes on the test's clock (a busy GCS); `fails` makes every read raise."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.dead: set[str] = set()
        self.answer_s = 0.0
        self.fails = False
        self.asked: list[str] = []

    async def dead_callers(self, callers: list[str]) -> set[str]:
        found = set()
        for caller in callers:
            self.asked.append(caller)
            self.clock.now += self.answer_s
            await asyncio.sleep(0)
            if self.fails:
                raise ConnectionError("the GCS is unavailable")
            if caller in self.dead:
                found.add(caller)
        return found


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("long") / "model", max_position_embeddings=8192)


async def held_replica(model, **kwargs) -> EngineDeployment:
    """A replica whose requests stop stepping once they have their first token: they run
    until their caller closes them or the replica aborts them, however slow the machine."""
    config = EngineConfig(model=str(model), num_kv_blocks=2100, block_size=4, max_model_len=8192)
    deployment = EngineDeployment.func_or_class(
        config, engine_cls=GatedEngine, metrics=EngineMetrics(FakeMetricsBackend()), **kwargs
    )
    await deployment.engine.call(GatedEngine.set_hold, "started")
    return deployment


@pytest.fixture
async def fleet(model):
    """A held replica on a clock the test moves, with a fake cluster answering whether its
    callers are alive."""
    clock = FakeClock()
    cluster = FakeCluster(clock)
    deployment = await held_replica(model, clock=clock, dead_callers=cluster.dead_callers)
    deployment._lease_task.cancel()  # the test sweeps by hand, on its own clock
    yield deployment, clock, cluster
    deployment.__del__()


async def start(deployment, request_id: str, caller: str | None):
    """A long request under `caller`, running (its first token out)."""
    sampling = SamplingParams(max_tokens=8000, temperature=0.0, ignore_eos=True)
    stream = deployment.generate(
        GenerateRequest(request_id, [5, 17, 200], sampling), caller, LEASE_S
    )
    assert (await anext(stream)).finish_reason is None
    return stream


async def idle(deployment) -> dict:
    """Stats once nothing runs (aborts land between steps). The deadline turns a hang into a
    failure: the engine is bound to get there."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = await deployment.stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError("the engine is still running requests")


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


async def sweep(deployment, clock: FakeClock, times: int, step_s: float = 0.6) -> None:
    for _ in range(times):
        clock.now += step_s
        await deployment.abort_abandoned()


class TestLiveCallersKeepTheirRequests:
    async def test_slow_answers_about_many_callers_abort_none(self, fleet):
        """Eight ingress replicas, a GCS that takes 0.2 s an answer: asking after all of them
        takes longer than a lease. (Aborting every caller whose lease lapsed by the end of the
        sweep lost 5 of these 8 live requests.)"""
        deployment, clock, cluster = fleet
        cluster.answer_s = 0.2
        streams = [await start(deployment, f"r{i}", f"ingress-{i}") for i in range(8)]
        await sweep(deployment, clock, 5)
        assert len(cluster.asked) >= 8 * 5
        stats = await deployment.stats()
        assert stats["num_running"] == 8 and deployment.num_abandoned == 0
        for stream in streams:
            await stream.aclose()
        assert (await idle(deployment))["num_aborted"] == 8

    async def test_a_liveness_check_that_fails_aborts_nothing(self, fleet):
        deployment, clock, cluster = fleet
        cluster.fails = True
        cluster.dead.add("ingress")  # even a dead caller keeps its requests while unsure
        stream = await start(deployment, "r", "ingress")
        for _ in range(3):
            clock.now += 0.6
            with pytest.raises(ConnectionError):
                await deployment.abort_abandoned()
        assert deployment.num_abandoned == 0
        cluster.fails = False  # the GCS is back: the dead caller's request goes
        await sweep(deployment, clock, 1)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].error.kind is ErrorKind.UNAVAILABLE and deployment.num_abandoned == 1

    async def test_a_live_caller_keeps_its_requests_without_sending_anything(self, fleet):
        """Under load a renewal call would queue behind the caller's own requests: liveness is
        asked of the cluster instead, only for callers whose lease lapsed, once a lease."""
        deployment, clock, cluster = fleet
        cluster.dead.add("dead-ingress")
        kept = await start(deployment, "kept", "live-ingress")
        orphan = await start(deployment, "orphan", "dead-ingress")
        await deployment.abort_abandoned()
        assert cluster.asked == []  # no lease lapsed yet: no one is asked
        await sweep(deployment, clock, 3)
        assert cluster.asked.count("dead-ingress") == 1 and cluster.asked.count("live-ingress") == 3
        chunks = [chunk async for chunk in orphan]
        assert (
            chunks[-1].finish_reason == "error" and chunks[-1].error.kind is ErrorKind.UNAVAILABLE
        )
        assert "caller went away" in chunks[-1].error.message
        stats = await deployment.stats()
        assert stats["num_running"] == 1 and stats["num_abandoned"] == 1
        assert abs(stats["abandoned_at"] - time.time()) < 60  # the wall clock, for benchmarks
        await kept.aclose()  # its caller hangs up: aborted too, and counted
        stats = await idle(deployment)
        assert stats["num_aborted"] == 2 and stats["num_abandoned"] == 1
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["num_held_slots"] == 0 and deployment.leases.num_tracked == 0

    async def test_a_request_reaching_the_replica_after_its_caller_was_found_dead_never_runs(
        self, fleet
    ):
        """Sent before the caller died, it reached the replica after (queued behind a busy
        loop): DEAD is final for an actor id, so it ends at once, counted, and holds nothing,
        where it used to be tracked anew and run until the next lease lapsed. Its channel
        ends at once too. (A chaos run on a loaded 2-core machine: the orphans' abort took
        2.96 s, 2.4 s of it one such late request.)"""
        deployment, clock, cluster = fleet
        cluster.dead.add("dead-ingress")
        orphan = await start(deployment, "orphan", "dead-ingress")
        await sweep(deployment, clock, 1)
        assert [chunk async for chunk in orphan][-1].error.kind is ErrorKind.UNAVAILABLE
        sampling = SamplingParams(max_tokens=8000, temperature=0.0, ignore_eos=True)
        late = deployment.generate(GenerateRequest("late", [5, 17], sampling), "dead-ingress")
        chunks = await asyncio.wait_for(collect(late), 30)  # it used to run: held, forever
        assert [c.finish_reason for c in chunks] == ["error"] and chunks[0].token_ids == []
        assert chunks[0].error.kind is ErrorKind.UNAVAILABLE
        assert "caller went away" in chunks[0].error.message
        assert deployment.num_abandoned == 2 and deployment.leases.num_tracked == 0
        assert [b async for b in deployment.channel("dead-ingress", deployment.replica_id)] == []
        stats = await idle(deployment)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert cluster.asked == ["dead-ingress"]  # found dead once, never asked again
        live = await start(deployment, "live", "live-ingress")  # other callers are untouched
        assert (await deployment.stats())["num_running"] == 1
        await live.aclose()

    async def test_requests_without_a_caller_are_never_abandoned(self, fleet):
        deployment, clock, cluster = fleet
        stream = await start(deployment, "anonymous", None)
        await sweep(deployment, clock, 3, step_s=1000.0)
        assert cluster.asked == [] and (await deployment.stats())["num_running"] == 1
        await stream.aclose()
        assert (await idle(deployment))["num_aborted"] == 1

    async def test_without_a_liveness_check_nothing_is_abandoned(self, model):
        """Built outside Serve, nothing can say a caller died: its requests run to the end."""
        clock = FakeClock()
        deployment = await held_replica(model, clock=clock)
        try:
            stream = await start(deployment, "r", "ingress")
            await sweep(deployment, clock, 3, step_s=1000.0)
            assert (await deployment.stats())["num_running"] == 1
            await stream.aclose()
        finally:
            deployment.__del__()


class TestGcsLiveness:
    async def test_only_a_dead_state_counts(self):
        states = {"a": "ALIVE", "b": "DEAD", "c": None, "d": "RESTARTING"}

        def read(actor_id: str):
            if actor_id == "e":
                raise ConnectionError("GCS unavailable")
            return states[actor_id]

        liveness = GcsLiveness(read=read)
        assert await liveness(["a", "b", "c", "d", "e"]) == {"b"}

    async def test_a_read_that_hangs_answers_none_dead_and_is_not_repeated(self):
        release = threading.Event()
        reads: list[str] = []

        def read(actor_id: str):
            reads.append(actor_id)
            release.wait(60)
            return "DEAD"

        liveness = GcsLiveness(timeout_s=0.05, read=read)
        assert await liveness(["a"]) == set()  # timed out: unsure
        assert await liveness(["a"]) == set()  # the first read still runs: not asked again
        assert reads == ["a"]
        release.set()
        await asyncio.to_thread(lambda: None)  # let the worker thread finish
        deadline = time.monotonic() + 60
        while liveness._reading is not None and not liveness._reading.done():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await liveness(["a"]) == {"a"}  # answered: asked afresh
