"""Scheduler and KV allocator invariants, without torch or Ray."""

import subprocess
import sys

import pytest

from replicas.kv_cache import BlockAllocator, OutOfBlocks, blocks_for
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduler import AdapterLoadError, Scheduler, SchedulerConfig


class FakeGate:
    """Adapter slots without weights: `capacity` slots, LRU-free reuse of unheld ones."""

    def __init__(self, capacity: int = 2, broken: tuple[str, ...] = ()) -> None:
        self.capacity = capacity
        self.holds: dict[str, int] = {}
        self.broken = broken
        self.still_reading: set[str] = set()
        self.copying: set[str] = set()  # long copies in flight
        self.settle_asks: list[tuple[str, int]] = []
        self.refs: dict[str, int] = {}  # adapter -> requests queued or running on it

    def attach(self, adapter: str) -> None:
        self.refs[adapter] = self.refs.get(adapter, 0) + 1

    def detach(self, adapter: str) -> None:
        assert self.refs.get(adapter, 0) > 0, "detached more often than attached"
        self.refs[adapter] -= 1
        if not self.refs[adapter]:
            del self.refs[adapter]

    def copy_settled(self, adapter: str, prefill_tokens: int = 0) -> bool:
        self.settle_asks.append((adapter, prefill_tokens))
        return adapter not in self.copying

    def is_resident(self, adapter: str) -> bool:
        return adapter in self.holds

    def prepare(self, adapter: str) -> bool:
        if adapter in self.broken:
            raise AdapterLoadError(f"adapter {adapter} is corrupt")
        return adapter not in self.still_reading

    def acquire(self, adapter: str) -> int | None:
        if adapter in self.broken:
            raise AdapterLoadError(f"adapter {adapter} is corrupt")
        if adapter not in self.holds:
            if len(self.holds) >= self.capacity:
                idle = [a for a, n in self.holds.items() if n == 0]
                if not idle:
                    return None
                del self.holds[idle[0]]
            self.holds[adapter] = 0
        self.holds[adapter] += 1
        return sorted(self.holds).index(adapter)

    def release(self, adapter: str) -> None:
        assert self.holds[adapter] > 0
        self.holds[adapter] -= 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, gate=None,
                   **config):
    blocks = BlockAllocator(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=1024, **config)
    return Scheduler(config, blocks, gate or FakeGate()), blocks


def req(rid, n_prompt=6, adapter=None, max_tokens=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   adapter)


def assert_no_block_overlap(scheduler: Scheduler, blocks: BlockAllocator) -> None:
    seen: set[int] = set()
    for r in scheduler.requests():
        assert not seen & set(r.block_table), "a KV block is owned by two requests"
        seen |= set(r.block_table)
    assert seen == blocks._used
    assert blocks.num_free + blocks.num_used == blocks.num_blocks


def run_step(scheduler: Scheduler, token: int = 7):
    """Pretend the model ran: advance computed tokens and sample for sequences that sample."""
    out = scheduler.schedule()
    for seq in out.seqs:
        samples = seq.samples
        seq.request.num_computed_tokens += seq.num_new_tokens
        if samples:
            r = seq.request
            r.output_token_ids.append(token)
            if len(r.output_token_ids) >= r.sampling.max_tokens:
                scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


class TestBlockAllocator:
    def test_never_hands_out_a_block_twice(self):
        a = BlockAllocator(10, 4)
        first, second = a.allocate(4), a.allocate(6)
        assert not set(first) & set(second)
        with pytest.raises(OutOfBlocks):
            a.allocate(1)
        a.free(first)
        assert sorted(a.allocate(4)) == sorted(first)

    def test_double_free_is_refused(self):
        a = BlockAllocator(4, 4)
        blocks = a.allocate(2)
        a.free(blocks)
        with pytest.raises(ValueError, match="not allocated"):
            a.free(blocks[:1])

    def test_grow_is_all_or_nothing(self):
        a = BlockAllocator(3, 4)
        table: list[int] = []
        assert a.grow(table, 8) and len(table) == 2
        assert not a.grow(table, 17)  # needs 5 blocks, only 3 exist
        assert len(table) == 2 and a.num_free == 1
        assert blocks_for(9, 4) == 3


class TestScheduling:
    def test_prefill_and_decode_share_a_step(self):
        s, blocks = make_scheduler()
        s.add(req("a"))
        run_step(s)
        s.add(req("b"))
        out = run_step(s)
        kinds = {seq.request.request_id: seq.num_new_tokens for seq in out.seqs}
        assert kinds == {"a": 1, "b": 6}
        assert_no_block_overlap(s, blocks)

    def test_token_budget_chunks_long_prefills(self):
        s, blocks = make_scheduler(budget=8)
        s.add(req("long", n_prompt=20))
        chunks = [run_step(s).seqs[0].num_new_tokens for _ in range(3)]
        assert chunks == [8, 8, 4]
        assert s.running[0].output_token_ids == [7]
        assert_no_block_overlap(s, blocks)

    def test_max_num_seqs_bounds_running(self):
        s, _ = make_scheduler(max_num_seqs=2)
        for i in range(5):
            s.add(req(f"r{i}"))
        run_step(s)
        assert len(s.running) == 2 and len(s.waiting) == 3

    def test_everything_is_freed_when_requests_finish(self):
        s, blocks = make_scheduler(gate=FakeGate(capacity=2))
        gate = s.adapters
        for i in range(6):
            s.add(req(f"r{i}", adapter=["x", "y", None][i % 3], max_tokens=3))
        for _ in range(50):
            if not s.has_work:
                break
            run_step(s)
            assert_no_block_overlap(s, blocks)
        assert not s.has_work
        assert blocks.num_free == blocks.num_blocks
        assert all(n == 0 for n in gate.holds.values())

    def test_abort_frees_blocks_and_slot(self):
        s, blocks = make_scheduler()
        s.add(req("a", adapter="x"))
        s.add(req("b"))
        run_step(s)
        aborted = s.abort("a")
        assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
        assert aborted.block_table == [] and aborted.slot is None
        assert s.adapters.holds["x"] == 0
        assert s.abort("a") is None
        s.abort("b")
        assert blocks.num_free == blocks.num_blocks

    def test_abort_of_waiting_request(self):
        s, blocks = make_scheduler(max_num_seqs=1)
        s.add(req("a"))
        s.add(req("b"))
        run_step(s)
        assert s.abort("b").status is RequestStatus.FINISHED_ABORTED
        assert [r.request_id for r in s.requests()] == ["a"]


class TestPreemption:
    def test_newest_request_is_preempted_when_blocks_run_out(self):
        # 6 blocks of 4 tokens; two 8-token prompts take 4 blocks, decoding needs more. No KV
        # headroom kept, so both are admitted at once.
        s, blocks = make_scheduler(num_blocks=6, block_size=4, kv_reserve_ratio=0.0,
                                   min_kv_reserve_ratio=0.0)
        s.add(req("old", n_prompt=8, max_tokens=20))
        s.add(req("new", n_prompt=8, max_tokens=20))
        preempted = []
        for _ in range(10):
            out = run_step(s)
            preempted += [r.request_id for r in out.preempted]
            assert_no_block_overlap(s, blocks)
        assert preempted and set(preempted) == {"new"}
        assert s.waiting[0].request_id == "new" and s.waiting[0].num_computed_tokens == 0
        old = next(r for r in s.running if r.request_id == "old")
        assert len(old.output_token_ids) == 10

    def test_preempted_request_recomputes_its_outputs(self):
        s, blocks = make_scheduler(num_blocks=5, block_size=4, kv_reserve_ratio=0.0,
                                   min_kv_reserve_ratio=0.0)
        s.add(req("a", n_prompt=8, max_tokens=6))
        s.add(req("b", n_prompt=8, max_tokens=6))
        for _ in range(40):
            if not s.has_work:
                break
            run_step(s)
            assert_no_block_overlap(s, blocks)
        assert not s.has_work and blocks.num_free == 5


def run_to_completion(s: Scheduler, blocks: BlockAllocator, arrivals: dict[int, list[Request]],
                      max_steps: int = 5000) -> tuple[int, int]:
    """Steps until every request finished (requests join at their step); returns the tokens
    computed (prompts recomputed after a preemption included) and the preemptions."""
    preemptions = computed = 0
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            s.add(r)
        if not s.has_work and step > max(arrivals):
            return computed, preemptions
        out = run_step(s)
        preemptions += len(out.preempted)
        computed += out.num_tokens
        assert_no_block_overlap(s, blocks)
    raise AssertionError("requests did not finish")


class TestKvHeadroom:
    def test_a_newcomer_waits_rather_than_crowd_out_running_outputs(self):
        # Each request grows to 5 of the 6 blocks: admitted together, one is preempted. With
        # the whole remaining output reserved, the newcomer waits for the first to finish.
        for ratio, expect_preemptions in ((0.0, True), (1.0, False)):
            s, blocks = make_scheduler(num_blocks=6, block_size=4, kv_reserve_ratio=ratio,
                                       min_kv_reserve_ratio=ratio)
            s.add(req("old", n_prompt=8, max_tokens=12))
            s.add(req("new", n_prompt=8, max_tokens=12))
            _, preemptions = run_to_completion(s, blocks, {0: []})
            assert (preemptions > 0) == expect_preemptions
            assert blocks.num_free == 6

    def test_ample_cache_admits_everyone_at_once(self):
        s, _ = make_scheduler(num_blocks=256, block_size=4, budget=64)
        for i in range(8):
            s.add(req(f"r{i}", n_prompt=6, max_tokens=16))
        assert len(s.schedule().seqs) == 8

    def test_a_request_open_to_the_end_of_a_long_context_reserves_a_bounded_share(self):
        # max_tokens left null runs to the end of the context (here 100k tokens): it must not
        # hold the cache for itself. 2,000 blocks of 16: its reserve is capped well below that.
        blocks = BlockAllocator(2000, 16)
        s = Scheduler(SchedulerConfig(8, 4096, max_model_len=100_000), blocks, FakeGate())
        s.add(req("open", n_prompt=64, max_tokens=100_000 - 64))
        for i in range(7):
            s.add(req(f"r{i}", n_prompt=64, max_tokens=64))
        assert len(s.schedule().seqs) == 8

    def test_an_idle_engine_admits_a_request_larger_than_its_reservation(self):
        # 4 blocks hold the prompt but not the 100 tokens it may produce: it runs anyway.
        s, blocks = make_scheduler(num_blocks=4, block_size=4)
        s.add(req("big", n_prompt=8, max_tokens=100))
        assert [seq.request.request_id for seq in s.schedule().seqs] == ["big"]

    def test_ratio_decays_without_preemption_and_resets_on_one(self):
        s, blocks = make_scheduler(num_blocks=6, block_size=4, kv_reserve_ratio=0.5,
                                   min_kv_reserve_ratio=0.1, kv_reserve_decay=0.1)
        s.add(req("a", n_prompt=4, max_tokens=2))
        for _ in range(3):
            run_step(s)
        assert s.reserve_ratio == pytest.approx(0.2)
        for _ in range(5):
            run_step(s)
        assert s.reserve_ratio == pytest.approx(0.1)  # the floor
        s.add(req("b", n_prompt=8, max_tokens=20))
        s.add(req("c", n_prompt=8, max_tokens=20))
        preempted = False
        while not preempted:
            preempted = bool(run_step(s).preempted)
        assert s.reserve_ratio == 0.5

    def test_steady_overload_preempts_less_and_everyone_finishes(self):
        # A request every other step, each growing to 40 tokens, into 40 blocks of 4.
        def arrivals():
            return {2 * i: [req(f"r{i}", n_prompt=12, max_tokens=28)] for i in range(40)}

        results = {}
        for name, ratio in (("none", 0.0), ("headroom", 0.5)):
            s, blocks = make_scheduler(num_blocks=40, block_size=4, budget=64,
                                       kv_reserve_ratio=ratio, min_kv_reserve_ratio=ratio * 0.1)
            results[name] = run_to_completion(s, blocks, arrivals())
        computed_none, preempted_none = results["none"]
        computed_headroom, preempted_headroom = results["headroom"]
        assert preempted_none > 0
        assert preempted_headroom < preempted_none / 2
        assert computed_headroom < computed_none  # less prefill thrown away and recomputed

    def test_config_refuses_a_floor_above_the_ratio(self):
        with pytest.raises(ValueError):
            SchedulerConfig(4, 32, 128, kv_reserve_ratio=0.1, min_kv_reserve_ratio=0.2)

    @pytest.mark.parametrize("ratio", [-0.1, 1.5])
    def test_engine_config_refuses_a_ratio_outside_0_1(self, ratio):
        from replicas.config import EngineConfig

        with pytest.raises(ValueError, match="kv_reserve_ratio"):
            EngineConfig(model="m", kv_reserve_ratio=ratio)


class TestAdapterAdmission:
    def test_request_waits_for_a_slot_and_does_not_block_others(self):
        gate = FakeGate(capacity=1)
        s, _ = make_scheduler(gate=gate)
        s.add(req("x1", adapter="x", max_tokens=5))
        run_step(s)
        s.add(req("y1", adapter="y"))  # needs a slot; x holds the only one
        s.add(req("base"))
        s.add(req("x2", adapter="x"))  # x is resident: may pass y1
        out = run_step(s)
        admitted = {seq.request.request_id for seq in out.seqs}
        assert {"base", "x2"} <= admitted and "y1" not in admitted

    def test_blocked_request_is_not_starved_by_new_adapters(self):
        gate = FakeGate(capacity=2)
        s, _ = make_scheduler(gate=gate)
        s.add(req("a1", adapter="a", max_tokens=3))
        s.add(req("b1", adapter="b", max_tokens=3))
        run_step(s)
        s.add(req("c1", adapter="c"))  # blocked: both slots held
        s.add(req("d1", adapter="d"))  # also needs a new slot: must not jump ahead of c1
        finished_order = []
        for _ in range(30):
            if not s.has_work:
                break
            before = {r.request_id for r in s.running}
            run_step(s)
            finished_order += sorted(before - {r.request_id for r in s.running})
        admitted_c = "c1" in finished_order
        assert admitted_c and finished_order.index("c1") <= finished_order.index("d1")

    def test_long_copy_waits_while_others_run_but_not_when_alone(self):
        gate = FakeGate(capacity=2)
        gate.copying.add("big")
        s, _ = make_scheduler(gate=gate)
        s.add(req("big-alone", adapter="big", max_tokens=2))
        assert [q.request.request_id for q in run_step(s).seqs] == ["big-alone"]  # nothing to stall
        s.add(req("big-2", adapter="big"))
        s.add(req("small", adapter="small"))
        admitted = {q.request.request_id for q in run_step(s).seqs}
        assert "small" in admitted and "big-2" not in admitted  # the others' step is not held up
        assert ("big", 6) in gate.settle_asks  # asked with the prompt it would prefill now
        gate.copying.discard("big")  # most of the copy has landed
        assert "big-2" in {q.request.request_id for q in run_step(s).seqs}

    def test_adapter_that_fails_to_load_fails_only_its_request(self):
        s, blocks = make_scheduler(gate=FakeGate(broken=("bad",)))
        s.add(req("bad1", adapter="bad"))
        s.add(req("ok"))
        out = s.schedule()
        assert [r.request_id for r in out.failed] == ["bad1"]
        assert out.failed[0].status is RequestStatus.FINISHED_ERROR
        assert "corrupt" in out.failed[0].error
        assert [seq.request.request_id for seq in out.seqs] == ["ok"]


class TestAdapterReferences:
    """Every queued or running request refers to its adapter once (`attach`), until it ends
    (`detach`): the references always equal the requests in the scheduler, by adapter."""

    @staticmethod
    def assert_refs_match(s: Scheduler, gate: FakeGate) -> None:
        counts: dict[str, int] = {}
        for r in s.requests():
            if r.adapter is not None:
                counts[r.adapter] = counts.get(r.adapter, 0) + 1
        assert gate.refs == counts

    def test_two_requests_on_one_adapter_hold_it_until_the_last_finishes(self):
        gate = FakeGate()
        s, _ = make_scheduler(gate=gate)
        s.add(req("short", adapter="x", max_tokens=1))
        s.add(req("long", adapter="x", max_tokens=3))
        s.add(req("base"))
        assert gate.refs == {"x": 2}
        run_step(s)  # "short" finishes
        assert gate.refs == {"x": 1}
        while s.has_work:
            run_step(s)
            self.assert_refs_match(s, gate)
        assert gate.refs == {} and gate.holds == {"x": 0}

    def test_an_abort_drops_the_reference_waiting_or_running(self):
        gate = FakeGate(capacity=1)
        s, _ = make_scheduler(gate=gate)
        s.add(req("running", adapter="x", max_tokens=5))
        run_step(s)
        s.add(req("waiting", adapter="y"))  # no slot for it: stays waiting
        run_step(s)
        assert gate.refs == {"x": 1, "y": 1}
        s.abort("waiting")
        s.abort("running")
        assert gate.refs == {} and gate.holds == {"x": 0}

    def test_a_failed_admission_drops_the_reference(self):
        gate = FakeGate(broken=("bad",))
        s, _ = make_scheduler(gate=gate)
        s.add(req("bad1", adapter="bad"))
        assert gate.refs == {"bad": 1}
        assert [r.request_id for r in s.schedule().failed] == ["bad1"]
        assert gate.refs == {}

    def test_a_preempted_request_keeps_its_reference_but_not_its_slot(self):
        gate = FakeGate(capacity=2)
        s, blocks = make_scheduler(gate=gate, num_blocks=6, block_size=4, kv_reserve_ratio=0.0,
                                   min_kv_reserve_ratio=0.0)
        s.add(req("old", n_prompt=8, adapter="x", max_tokens=12))
        s.add(req("new", n_prompt=8, adapter="y", max_tokens=12))
        preempted = False
        while s.has_work:
            out = run_step(s)
            self.assert_refs_match(s, gate)
            if any(r.request_id == "new" for r in out.preempted):
                preempted = True
                assert gate.refs["y"] == 1 and gate.holds["y"] == 0  # queued, holding no slot
        assert preempted and gate.refs == {}
        assert blocks.num_free == 6 and gate.holds == {"x": 0, "y": 0}  # readmitted, finished


def test_policy_modules_import_without_torch():
    code = (
        "import sys, replicas.scheduler, replicas.kv_cache, replicas.adapters.slot_pool, "
        "replicas.adapters.host_cache, replicas.adapters.prefetcher; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
