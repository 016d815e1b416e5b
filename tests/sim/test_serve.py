"""Ray Serve's routing rules as the simulator models them (sim/serve.py): MultiplexMixin's
candidates, the max_ongoing_requests hold, the queue-length cache, and what replicas publish."""

from __future__ import annotations

import random

import pytest

from sim.calibration import Calibration, StepCost
from sim.events import EventLoop
from sim.fleet import Fleet, FleetConfig
from sim.replica import ReplicaConfig
from sim.serve import Pow2Choice, ReplicaInfo, Router, ServeConfig, SimRequest
from sim.workload import Arrival, Workload

CAL = Calibration(
    step=StepCost(base_s=0.01, per_seq_s=0.0, per_adapter_s=0.0, prefill_token_s=0.0),
    copy_s=0.002,
    read_s=0.05,
    adapter_bytes=1 << 20,
)


class NoEndpoint:
    def probe(self, replica_id):
        return 0

    def deliver(self, request, replica_id, router):
        pass

    def hint(self, replica_id, adapter):
        pass


def pow2_router(models: dict[str, set[str]], seed: int = 0) -> tuple[Router, Pow2Choice]:
    """A router over replicas reporting `models` (replica id -> multiplexed model ids)."""
    config = ServeConfig()
    choice = Pow2Choice(random.Random(seed), config)
    router = Router("r", EventLoop(), NoEndpoint(), choice, config, random.Random(seed))
    router.update_replicas([ReplicaInfo(rid, frozenset(m)) for rid, m in models.items()])
    return router, choice


def request(adapter: str, t: float = 0.0) -> SimRequest:
    return SimRequest("q", adapter, 10, 10, created_at=t)


class TestMultiplexCandidates:
    """MultiplexMixin.apply_multiplex_routing, within and after the matching timeout."""

    MODELS = {"a": {"x", "y"}, "b": {"z"}, "c": set(), "d": set()}

    def test_replicas_reporting_the_model_come_first(self):
        router, choice = pow2_router(self.MODELS)
        assert choice.choose_replicas(router, request("z")) == [["b"]]

    def test_no_match_falls_back_to_the_fewest_models_once_per_model(self):
        router, choice = pow2_router(self.MODELS)
        first = choice.choose_replicas(router, request("new"))
        assert len(first[0]) == 2 and set(first[0]) == {"c", "d"}
        # A second request for the same model finds it in the fallback set: no candidates
        # until the first one's replica reports it, or until its own retry.
        second = request("new")
        assert choice.choose_replicas(router, second) == []
        assert set(choice.choose_replicas(router, second)[0]) == {"c", "d"}

    def test_a_retry_within_the_timeout_tries_the_fewest_models(self):
        router, choice = pow2_router(self.MODELS)
        r = request("z")
        assert choice.choose_replicas(router, r) == [["b"]]  # b was busy, say
        assert set(choice.choose_replicas(router, r)[0]) == {"c", "d"}

    def test_after_the_timeout_fewest_once_then_any(self):
        router, choice = pow2_router(self.MODELS)
        r = request("z")
        choice.choose_replicas(router, r)
        router.loop._now = 2.5  # past the matching timeout, drawn from [1, 2] s
        assert set(choice.choose_replicas(router, r)[0]) == {"c", "d"}
        seen = set()
        for _ in range(50):
            seen.update(choice.choose_replicas(router, r)[0])
        assert seen == {"a", "b", "c", "d"}


def fleet(router: str, arrivals: list[Arrival], **serve) -> Fleet:
    config = FleetConfig(
        num_replicas=1,
        router=router,
        replica=ReplicaConfig(max_num_seqs=8, max_loras_per_batch=2),
        serve=ServeConfig(**serve),
    )
    return Fleet(config, Workload((), tuple(arrivals), None), CAL)


@pytest.mark.parametrize("router", ["pow2", "affinity"])
def test_requests_beyond_max_ongoing_wait_in_the_router(router):
    # Five at once, two allowed on the replica: the third goes only after one finishes.
    arrivals = [Arrival(0.0, "a", 16, 20) for _ in range(5)]
    f = fleet(router, arrivals, max_ongoing_requests=2)
    result = f.run()
    assert result.completed == 5
    replica = f.replicas["replica-000"]
    assert replica.engine.scheduler.config.max_num_seqs == 8  # the engine had room: Serve held
    first_done = min(r.finished_at for r in f.requests)
    waited = sorted(f.requests, key=lambda r: r.first_token_at)[2:]
    assert all(r.first_token_at >= first_done - 0.01 for r in waited)


def test_the_queue_length_cache_expires():
    router, _ = pow2_router({"a": set()})
    router._cache_set("a", 3)
    assert router.cached_queue_len("a") == 3
    router.loop._now = 10.5  # RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S = 10
    assert router.cached_queue_len("a") is None


def test_loading_adapters_are_published_as_multiplexed_ids():
    # The engine deployment reports GPU and loading adapters; a 2 s disk read keeps "slow"
    # loading long after the residency push (0.1 s), the control loop (0.1 s) and the broadcast.
    cal = Calibration(step=CAL.step, copy_s=0.002, read_s=2.0, adapter_bytes=1 << 20)
    config = FleetConfig(num_replicas=1, router="pow2", replica=ReplicaConfig())
    f = Fleet(config, Workload((), (Arrival(0.0, "slow", 16, 4),), None), cal)
    f.loop.at(0.0, f._send, f.workload.measured[0], True)
    f.loop.run(max_t=0.5)
    info = f.routers[0].replicas["replica-000"]
    assert "slow" in info.multiplexed_model_ids
    assert info.routing_stats["loading"] == ["slow"] and info.routing_stats["gpu"] == []


class TestRouterStart:
    """A caller's router starts with its handle's first request (`DeploymentHandle._init`) and
    its first long poll is answered at once with the replicas already running, so the first
    requests are routed on arrival, not held until the controller's next control loop."""

    @pytest.mark.parametrize("router", ["pow2", "affinity"])
    def test_the_first_requests_reach_a_replica_before_the_control_loop(self, router):
        config = FleetConfig(num_replicas=2, router=router, num_routers=2)
        burst = tuple(Arrival(0.0, f"a{i}", 16, 4) for i in range(8))
        f = Fleet(config, Workload((), burst, None), CAL)
        for arrival in burst:
            f.loop.at(0.0, f._send, arrival, True)
        serve = config.serve
        f.loop.run(max_t=serve.broadcast_s + 4 * serve.rpc_s)
        assert serve.broadcast_s + 4 * serve.rpc_s < serve.control_loop_s
        assert all(r.engine is not None for r in f.requests)  # each on a replica's engine

    def test_a_router_connects_on_its_first_request_only(self):
        config = FleetConfig(num_replicas=2, router="pow2", num_routers=3)
        f = Fleet(config, Workload((), (Arrival(0.0, "a", 16, 4),), None), CAL)
        assert not any(r.started for r in f.routers)
        f.loop.at(0.0, f._send, f.workload.measured[0], True)
        f.loop.run(max_t=0.05)
        started = [r for r in f.routers if r.started]
        assert len(started) == 1 and set(started[0].replicas) == set(f.replicas)
        assert f.controller.routers == started  # broadcasts go to started routers only
