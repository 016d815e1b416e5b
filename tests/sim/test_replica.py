"""One simulated replica: the engine's own scheduler, slot pool, host cache, prefetch queue and
copy budget on the virtual clock, with the device and the disk replaced by calibrated times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from replicas.adapters.host_cache import HostCache
from replicas.adapters.policy import CopyBudget
from replicas.adapters.prefetcher import PrefetchQueue
from replicas.adapters.slot_pool import SlotPool
from replicas.request import RequestStatus
from replicas.scheduler import Scheduler
from sim import replica as sim_replica
from sim.calibration import Calibration, StepCost
from sim.events import EventLoop
from sim.replica import ReplicaConfig, SimAdapters, SimReplica, make_request

CAL = Calibration(
    step=StepCost(base_s=0.01, per_seq_s=0.0005, per_adapter_s=0.0, prefill_token_s=1e-5),
    copy_s=0.002,
    read_s=0.05,
    adapter_bytes=80 << 20,
)


class Run:
    def __init__(self, **config) -> None:
        self.loop = EventLoop()
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.replica = SimReplica(
            "r", self.loop, CAL, ReplicaConfig(**config), self._token, self._done
        )

    def _token(self, request, first: bool) -> None:
        self.tokens[request.request_id] = self.tokens.get(request.request_id, 0) + 1
        if first:
            self.first[request.request_id] = self.loop.now()

    def _done(self, request) -> None:
        self.done[request.request_id] = self.loop.now()

    def at(self, t: float, rid: str, adapter: str | None, prompt: int = 64, output: int = 8):
        def submit():
            self.replica.submit(make_request(rid, adapter, prompt, output, self.loop.now()))

        self.loop.at(t, submit)


def test_the_parts_are_the_engines_own():
    r = Run().replica
    assert isinstance(r.scheduler, Scheduler)
    assert isinstance(r.adapters.slots, SlotPool)
    assert isinstance(r.adapters.host, HostCache)
    assert isinstance(r.adapters.queue, PrefetchQueue)
    assert isinstance(r.adapters.budget, CopyBudget)


def test_hint_lifetime_matches_the_adapter_manager():
    from replicas.adapters.manager import HINT_TTL_S

    assert sim_replica.HINT_TTL_S == HINT_TTL_S


def test_many_adapters_over_few_slots_all_finish_and_release_everything():
    run = Run(max_loras_per_batch=2, max_loaded_loras=4, max_num_seqs=4)
    for i in range(40):
        run.at(0.005 * i, f"q{i}", f"a{i % 7}" if i % 5 else None, output=3 + i % 4)
    run.loop.run()
    r = run.replica
    assert len(run.done) == 40
    assert all(run.tokens[f"q{i}"] == 3 + i % 4 for i in range(40))
    assert not r.scheduler.has_work
    assert r.blocks.num_free == r.blocks.num_blocks
    assert all(r.adapters.slots.holds(a) == 0 for a in r.adapters.slots.resident)
    assert r.adapters.gpu_loads > 2  # seven adapters went through two slots
    assert len(r.adapters.host) <= 4


def test_a_cold_adapter_costs_its_read_and_copy():
    run = Run()
    run.at(0.0, "cold", "a")
    run.loop.run()
    assert run.first["cold"] >= CAL.read_s + CAL.copy_s
    # The prefetcher loads a waiting request's adapter before admission finds it resident.
    assert run.replica.adapters.disk_reads == 1 and run.replica.adapters.gpu_loads == 1


def test_a_read_reuses_the_pinned_buffers_an_eviction_gave_back():
    # Two host entries: "a" and "b" fill them, each read allocating; "c" too (nothing was
    # evicted when it started), and its arrival evicts "a"; "d" reads into "a"'s buffers.
    loop = EventLoop()
    cal = replace(CAL, reused_reads=((16, 0.01),))
    adapters = SimAdapters(loop, cal, ReplicaConfig(max_loras_per_batch=1, max_loaded_loras=2))
    took = []
    for name in "abcd":
        start = loop.now()
        assert not adapters.prepare(name)  # the read starts
        loop.run()
        assert adapters.prepare(name)  # read and in host memory
        took.append(loop.now() - start)
    assert took == pytest.approx([CAL.read_s, CAL.read_s, CAL.read_s, 0.01])
    assert set(adapters.host) == {"c", "d"} and adapters.disk_reads == 4


def test_a_hint_loads_the_adapter_before_its_request():
    run = Run()
    run.at(0.0, "busy", "b", output=100)  # the engine is stepping when the hint comes
    run.loop.at(0.05, run.replica.prefetch_hint, "a")
    run.at(0.3, "warm", "a")
    run.loop.run()
    assert run.replica.adapters.prefetch_loads == 2  # "b" for its waiting request, "a" hinted
    assert run.first["warm"] - 0.3 < CAL.read_s  # no disk read on its path


def test_an_idle_engine_acts_on_a_hint_only_when_work_comes():
    # EngineLoop.run steps only while the engine has work: a hint to an idle one waits.
    run = Run()
    run.loop.at(0.0, run.replica.prefetch_hint, "a")
    run.at(0.3, "late", "a")
    run.loop.run()
    assert run.first["late"] - 0.3 >= CAL.read_s


def test_routing_stats_say_where_each_adapter_is():
    run = Run(max_loras_per_batch=1)
    run.at(0.0, "q0", "a")
    run.at(0.0, "q1", "b")
    run.loop.run(max_t=0.03)  # "a" is being read (its turn first), "b" waits its turn
    stats = run.replica.routing_stats()
    assert stats.loading == ("a",) and stats.gpu == () and stats.num_waiting == 2
    run.loop.run()
    stats = run.replica.routing_stats()
    assert stats.gpu == ("b",) and stats.host == ("a",) and stats.free_slots == 0


def test_a_killed_replica_aborts_what_it_holds():
    run = Run()
    for i in range(3):
        run.at(0.0, f"q{i}", "a", output=50)
    run.loop.run(max_t=0.2)
    lost = run.replica.kill()
    assert len(lost) == 3 and all(r.status is RequestStatus.FINISHED_ABORTED for r in lost)
    assert set(run.done) == {"q0", "q1", "q2"}
