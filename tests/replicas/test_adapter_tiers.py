"""Adapter tiers, loading modes and management, on CPU: outputs still equal PEFT while adapters
churn through fewer slots than adapters, and no slot is overwritten while a request uses it."""

import threading
import time

import pytest
import torch

from replicas.adapters import policy
from replicas.adapters.policy import CopyBudget
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind
from replicas.lora import LORA_GROUPS
from replicas.request import Request
from tests.factories import hf_greedy, make_adapter
from tests.replicas.conftest import greedy, make_engine, run_to_completion

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9], [8, 8, 8], [100, 2, 77]]


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    targets = [
        ["q_proj", "v_proj"],
        ALL,
        ["o_proj", "down_proj"],
        ["k_proj", "up_proj"],
        ["gate_proj"],
    ]
    return {
        f"ad{i}": make_adapter(
            models["llama"],
            root / f"ad{i}",
            rank=2 + 2 * i,
            lora_alpha=16,
            target_modules=targets[i],
            seed=10 + i,
        )
        for i in range(5)
    }


def fleet_engine(models, fleet, **kw):
    return make_engine(models["llama"], adapters=tuple((k, str(v)) for k, v in fleet.items()), **kw)


def assert_slots_hold_their_adapters(engine) -> None:
    """Poison check: every slot held by a running request holds exactly its adapter."""
    manager, pool = engine.adapters, engine.runner.lora_pool
    R = pool.max_rank
    for request in engine.scheduler.running:
        if request.adapter is None:
            continue
        slot = manager.slots.slot_of(request.adapter)
        assert slot == request.slot, "a running request's adapter left its slot"
        weights = manager.host.peek(request.adapter)
        if weights is None:
            continue
        for layer in (0, engine.spec.num_layers - 1):
            for group, targets in LORA_GROUPS.items():
                a = pool.a[layer][group][slot]
                for i, target in enumerate(targets):
                    pair = weights.modules.get((layer, target))
                    rows = a[i * R : (i + 1) * R]
                    if pair is None:
                        assert not rows.any(), f"{target} of slot {slot} should be empty"
                    else:
                        r = pair[0].shape[0]
                        assert torch.equal(rows[:r], pair[0]), f"slot {slot} {target} overwritten"
                        assert not rows[r:].any()


def drive(engine, requests, check=None, timeout_s=300):
    for r in requests:
        engine.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    deadline = time.monotonic() + timeout_s
    while engine.has_work and time.monotonic() < deadline:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if check:
            check(engine)
        if engine.stalled:
            time.sleep(0.001)
    assert not engine.has_work
    return tokens


@pytest.mark.parametrize("mode", ["blocking", "overlap", "prefetch"])
def test_churn_through_fewer_slots_matches_peft(models, fleet, mode):
    engine = fleet_engine(
        models, fleet, max_loras_per_batch=2, max_loaded_loras=2, adapter_loading=mode
    )
    requests, expected = [], {}
    for i, prompt in enumerate(PROMPTS):
        for j, name in enumerate(fleet):
            rid = f"{name}-{i}"
            n = 3 + (i + j) % 4
            requests.append(Request(rid, prompt, greedy(n), name))
            expected[rid] = hf_greedy(models["llama"], prompt, n, adapter_dir=fleet[name])
    tokens = drive(engine, requests, check=assert_slots_hold_their_adapters)
    assert tokens == expected
    assert engine.adapters.slots.num_held == 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_ready_requests_keep_running_while_a_cold_adapter_loads(models, fleet):
    engine = fleet_engine(models, fleet, adapter_loading="overlap")
    manager = engine.adapters
    real_read = manager.reader.read_file
    release = threading.Event()  # ad1's disk read finishes only when the test says so

    def slow_read(adapter, path):
        if adapter == "ad1":
            release.wait(30)
        return real_read(adapter, path)

    manager.reader.read_file = slow_read
    run_to_completion(engine, [Request("warm", PROMPTS[0], greedy(1), "ad0")])  # ad0 resident
    engine.add_request(Request("cold", PROMPTS[1], greedy(4), "ad1"))
    engine.add_request(Request("hot", PROMPTS[1], greedy(6), "ad0"))
    engine.add_request(Request("base", PROMPTS[1], greedy(6)))
    first_token_step = {}
    step = 0
    deadline = time.monotonic() + 60
    while engine.has_work and time.monotonic() < deadline:
        step += 1
        for out in engine.step():
            if out.new_token_ids:
                first_token_step.setdefault(out.request_id, step)
        if not {"hot", "base"} & {r.request_id for r in engine.scheduler.requests()}:
            release.set()
        if engine.stalled:
            time.sleep(0.001)
    assert first_token_step["hot"] == first_token_step["base"] == 1
    assert first_token_step["cold"] > 6  # hot and base finished while ad1 was still reading


def test_pinned_adapter_is_never_evicted(models, fleet):
    engine = fleet_engine(
        models, fleet, max_loras_per_batch=2, max_loaded_loras=2, pinned_adapters=("ad0",)
    )
    run_to_completion(engine, [Request("p", PROMPTS[0], greedy(1), "ad0")])
    slot = engine.adapters.slots.slot_of("ad0")

    def pinned_stays(e):
        assert e.adapters.slots.slot_of("ad0") == slot

    requests = [
        Request(f"{n}-{i}", p, greedy(3), n)
        for i, p in enumerate(PROMPTS)
        for n in ("ad1", "ad2", "ad3")
    ]
    drive(engine, requests, check=pinned_stays)
    assert engine.adapters.stats.gpu_loads >= 4  # the others churned through the other slot


def test_unload_during_use(models, fleet):
    engine = fleet_engine(models, fleet)
    engine.add_request(Request("long", PROMPTS[1], greedy(12), "ad2"))
    tokens = []
    for _ in range(3):
        while not (outs := engine.step()) and engine.has_work:
            time.sleep(0.001)
        tokens += [t for o in outs for t in o.new_token_ids]
    engine.unload_adapter("ad2")
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("new", PROMPTS[0], greedy(2), "ad2"))
    assert e.value.kind is ErrorKind.NOT_FOUND
    while engine.has_work:
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == hf_greedy(models["llama"], PROMPTS[1], 12, adapter_dir=fleet["ad2"])
    # Dropped with its last request, with no step after it: an idle engine keeps nothing.
    assert "ad2" not in engine.adapter_status()
    assert engine.stats().resident_adapters == {}
    with pytest.raises(RequestRejected):
        engine.unload_adapter("ad2")


def first_tokens(engine) -> list[int]:
    """Step until some request has a token; returns the tokens of that step."""
    while not (outs := engine.step()):
        assert engine.has_work
        time.sleep(0.001)
    return [t for o in outs for t in o.new_token_ids]


def test_reload_while_the_old_version_runs(models, fleet):
    """Unload a name while a request uses it and load it again at once with other weights: the
    load succeeds, the running request finishes on the old weights, new ones get the new
    weights, and the old version's slot is freed when its request ends."""
    engine = fleet_engine(models, fleet, max_loras_per_batch=3)
    engine.load_adapter("x", str(fleet["ad1"]))
    engine.add_request(Request("old", PROMPTS[1], greedy(6), "x"))
    tokens = {"old": first_tokens(engine), "new": []}
    engine.unload_adapter("x")
    engine.load_adapter("x", str(fleet["ad3"]))  # the name is free at once
    engine.add_request(Request("new", PROMPTS[1], greedy(6), "x"))
    assert len(engine.stats().resident_adapters) == 1  # the new version's copy is not in yet
    assert engine.adapter_status()["x"]["unloading"] is False  # the live version is listed
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["old"] == hf_greedy(models["llama"], PROMPTS[1], 6, adapter_dir=fleet["ad1"])
    assert tokens["new"] == hf_greedy(models["llama"], PROMPTS[1], 6, adapter_dir=fleet["ad3"])
    assert list(engine.stats().resident_adapters) == ["x#2"]  # the old version's slot is free
    engine.unload_adapter("x")
    assert engine.stats().resident_adapters == {} and "x" not in engine.adapter_status()


def test_aborting_the_last_request_of_an_unloaded_version_frees_it(models, fleet):
    engine = fleet_engine(models, fleet)
    engine.add_request(Request("r", PROMPTS[0], greedy(8), "ad2"))
    first_tokens(engine)
    engine.unload_adapter("ad2")
    assert list(engine.stats().resident_adapters) == ["ad2"]  # still read by "r"
    engine.abort("r")
    assert engine.stats().resident_adapters == {} and not engine.has_work
    engine.load_adapter("ad2", str(fleet["ad2"]))


def test_an_unloaded_version_outlives_a_preemption_and_goes_with_its_last_request(models, fleet):
    """Two requests on one adapter, unloaded while both run; the KV cache holds only one of
    them, so the newer is preempted and waits without a slot hold. The version stays (a waiting
    request still refers to it) while the older finishes, the newer is readmitted and ends on
    the old weights, and its end drops the version."""
    engine = fleet_engine(models, fleet, num_kv_blocks=6, max_model_len=24, kv_reserve_ratio=0.0)
    engine.add_request(Request("old", PROMPTS[1], greedy(12), "ad2"))
    engine.add_request(Request("new", PROMPTS[1], greedy(12), "ad2"))
    tokens: dict[str, list[int]] = {"old": [], "new": []}
    unloaded = waited_alone = False
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.stalled:
            time.sleep(0.001)
        if not unloaded and engine.scheduler.running:
            engine.unload_adapter("ad2")
            unloaded = True
        if unloaded and engine.has_work:
            assert engine.adapter_status()["ad2"]["unloading"] is True  # a request refers to it
            waiting = [r.request_id for r in engine.scheduler.waiting]
            waited_alone |= waiting == ["new"] and len(tokens["old"]) == 12  # "old" ended
    assert engine.num_preemptions > 0 and waited_alone
    expected = hf_greedy(models["llama"], PROMPTS[1], 12, adapter_dir=fleet["ad2"])
    assert tokens == {"old": expected, "new": expected}
    assert "ad2" not in engine.adapter_status() and engine.stats().resident_adapters == {}


def test_load_adapter_at_run_time(models, fleet, tmp_path):
    engine = make_engine(models["llama"])
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("x", PROMPTS[0], greedy(2), "late"))
    assert e.value.kind is ErrorKind.NOT_FOUND
    engine.load_adapter("late", str(fleet["ad3"]))
    with pytest.raises(RequestRejected, match="already loaded"):
        engine.load_adapter("late", str(fleet["ad3"]))
    with pytest.raises(RequestRejected, match="does not exist"):
        engine.load_adapter("nowhere", str(tmp_path / "missing"))
    out = run_to_completion(engine, [Request("y", PROMPTS[0], greedy(4), "late")])
    assert out["y"][0] == hf_greedy(models["llama"], PROMPTS[0], 4, adapter_dir=fleet["ad3"])


def test_prefetch_hint_brings_the_adapter_in_before_its_request(models, fleet):
    engine = fleet_engine(models, fleet)
    engine.prefetch_hint("ad4", eta_s=0.5)
    engine.prefetch_hint("not-an-adapter")  # ignored
    deadline = time.monotonic() + 30
    while engine.adapter_status().get("ad4", {}).get("tier") != "gpu":
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.005)
    assert engine.adapters.stats.prefetch_loads == 1
    run_to_completion(engine, [Request("r", PROMPTS[0], greedy(2), "ad4")])
    assert engine.adapters.stats.hits == 1 and engine.adapters.stats.misses == 0


def test_status_reports_tiers(models, fleet):
    engine = fleet_engine(models, fleet, max_loras_per_batch=1, max_loaded_loras=2)
    run_to_completion(engine, [Request("a", PROMPTS[0], greedy(1), "ad0")])
    run_to_completion(engine, [Request("b", PROMPTS[0], greedy(1), "ad1")])
    status = engine.adapter_status()
    assert status["ad1"]["tier"] == "gpu" and status["ad1"]["rank"] == 4
    assert status["ad0"]["tier"] == "host" and status["ad0"]["size_bytes"] > 0
    assert status["ad4"]["tier"] == "disk"


def test_unload_when_idle_frees_the_name_at_once(models, fleet):
    engine = fleet_engine(models, fleet)
    engine.prefetch_hint("ad2")  # a disk read may be in flight when the unload comes
    engine.unload_adapter("ad2")
    assert "ad2" not in engine.adapter_status()
    engine.load_adapter("ad2", str(fleet["ad3"]))  # same name, other weights
    out = run_to_completion(engine, [Request("r", PROMPTS[0], greedy(4), "ad2")])
    assert out["r"][0] == hf_greedy(models["llama"], PROMPTS[0], 4, adapter_dir=fleet["ad3"])


def test_cold_adapters_arriving_together_prefill_in_one_step(models, fleet):
    engine = fleet_engine(models, fleet, max_loras_per_batch=3)
    for name in ("ad1", "ad2", "ad3"):  # in host memory, no slot yet
        while not engine.adapters.prepare(name):
            time.sleep(0.005)
    assert not any(engine.adapters.is_resident(n) for n in ("ad1", "ad2", "ad3"))
    for i, name in enumerate(("ad1", "ad2", "ad3")):
        engine.add_request(Request(name, PROMPTS[i], greedy(2), name))
    first = engine.step()
    assert sorted(o.request_id for o in first if o.new_token_ids) == ["ad1", "ad2", "ad3"]
    assert engine.max_adapters_in_step == 3


class FakeEvent:
    """A load-stream event whose completion the test decides."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def record_copies(engine, monkeypatch) -> list[list[FakeEvent]]:
    """Slot writes still happen (on CPU, at once) but report per-layer events that stay pending
    until the test lands them, as copies on a GPU load stream would."""
    copies = []
    pool = engine.runner.lora_pool
    write = pool.write

    def write_with_events(slot, weights, stream=None):
        write(slot, weights, None)
        copies.append([FakeEvent() for _ in range(engine.spec.num_layers)])
        return copies[-1]

    monkeypatch.setattr(pool, "write", write_with_events)
    # the window follows step_time_s alone
    monkeypatch.setattr(engine.adapters, "budget", CopyBudget(short_copy_s=0.0))
    return copies


def land(events) -> None:
    for e in events:
        e.done = True


def two_copies_in_flight(models, fleet, monkeypatch):
    """ad1's copy, then ad2's behind it, both pending: (manager, their events, their sizes)."""
    engine = fleet_engine(models, fleet, max_loras_per_batch=3)
    manager = engine.adapters
    copies = record_copies(engine, monkeypatch)
    for name in ("ad1", "ad2"):
        while not manager.prepare(name):
            time.sleep(0.005)
    size = {n: manager.host.peek(n).nbytes for n in ("ad1", "ad2")}
    manager.acquire("ad1")
    manager.acquire("ad2")
    return manager, copies, size


def test_copy_settled_counts_the_copies_queued_ahead(models, fleet, monkeypatch):
    manager, copies, size = two_copies_in_flight(models, fleet, monkeypatch)
    assert len(copies) == 2
    # Each copy alone fits the window; the second behind the first does not.
    budget = manager.budget
    budget.step_time_s = max(size.values()) * 1.01 / (policy.COPY_STEPS * policy.COPY_BYTES_PER_S)
    assert max(size.values()) <= budget.window_bytes < sum(size.values())
    assert manager.copy_settled("ad1")
    assert not manager.copy_settled("ad2")
    mid = len(copies[1]) // 2
    copies[1][mid].done = True  # the second copy's middle layer landed: most of it is there
    assert manager.copy_settled("ad2")
    copies[1][mid].done = False
    land(copies[0])  # nothing ahead of it any more
    assert manager.copy_settled("ad2")
    assert manager.status()["ad2"]["tier"] == "loading"
    land(copies[1])
    assert manager.status()["ad2"]["tier"] == "gpu"


def test_copy_settled_counts_only_the_layers_still_to_land(models, fleet, monkeypatch):
    """A copy started during the previous step is partly there: admission counts the layers
    not yet landed (they land in order), its own and those of the copies ahead of it."""
    manager, copies, size = two_copies_in_flight(models, fleet, monkeypatch)
    layers = len(copies[0])
    assert layers >= 2
    rest = size["ad1"] * (layers - 1) // layers  # of ad1, once its first layer landed
    budget = manager.budget
    budget.step_time_s = (rest + size["ad2"]) / (policy.COPY_STEPS * policy.COPY_BYTES_PER_S)
    assert budget.window_bytes < size["ad1"] + size["ad2"]
    assert not manager.copy_settled("ad2")
    copies[0][0].done = True  # ad1's first layer is in
    assert manager.copy_settled("ad2")
    assert manager.uploader.queued_bytes() == rest + size["ad2"]


def test_copy_settled_counts_the_requests_own_prefill(models, fleet, monkeypatch):
    """A long prompt's step takes longer: the copy may land under its prefill."""
    manager, copies, size = two_copies_in_flight(models, fleet, monkeypatch)
    queued = size["ad1"] + size["ad2"]
    budget = manager.budget
    budget.step_time_s = 0.0  # the window is the short copy's alone
    assert budget.window_bytes < queued
    budget.prefill_token_s = 1e-4
    tokens_needed = (queued - budget.window_bytes) / (1e-4 * policy.COPY_BYTES_PER_S)
    assert not manager.copy_settled("ad2", prefill_tokens=int(tokens_needed) - 1)
    assert manager.copy_settled("ad2", prefill_tokens=int(tokens_needed) + 1)
    assert not manager.copy_settled("ad2")


def test_prefetch_queues_no_more_than_the_copy_window(models, fleet, monkeypatch):
    engine = fleet_engine(models, fleet, max_loras_per_batch=4)
    manager = engine.adapters
    copies = record_copies(engine, monkeypatch)
    names = ["ad1", "ad2", "ad3"]
    for name in names:
        while not manager.prepare(name):
            time.sleep(0.005)
    size = [manager.host.peek(n).nbytes for n in names]
    # Room for any one copy, never for two in a row.
    window = min(size[0] + size[1], size[1] + size[2]) - 1
    assert window >= max(size)
    manager.budget.step_time_s = window / (policy.COPY_STEPS * policy.COPY_BYTES_PER_S)
    now = time.monotonic()
    waiting = [(name, now + i) for i, name in enumerate(names)]
    manager.tick(waiting, now)
    assert manager.stats.prefetch_loads == 1 and manager.is_resident("ad1")
    manager.tick(waiting[1:], now)
    assert manager.stats.prefetch_loads == 1, "a second copy queued behind an unlanded one"
    land(copies[0])
    manager.tick(waiting[1:], now)
    assert manager.stats.prefetch_loads == 2 and manager.is_resident("ad2")
    assert not manager.is_resident("ad3")
    # Admission is not bound by the window: a request admitted now loads its adapter at once.
    assert manager.acquire("ad3") is not None and len(copies) == 3


def test_step_timings_mark_the_steps_that_waited_on_a_load(models, fleet):
    engine = fleet_engine(
        models, fleet, max_loras_per_batch=2, max_loaded_loras=5, adapter_loading="blocking"
    )
    names = list(fleet)[:3]
    for name in names:  # one at a time: each admission loads its adapter into a slot
        drive(engine, [Request(f"{name}-t", PROMPTS[0], greedy(3), name)])
    timings = engine.step_timings()
    assert len(timings) == engine.num_steps
    assert all(0 <= t.launch_s <= t.total_s for t in timings)
    prefill = [t for t in timings if t.num_tokens > t.num_seqs]
    assert len(prefill) == len(names)  # one prompt each, no decode step computes more tokens
    gated = [t for t in timings if t.gated]
    assert gated == prefill  # the admitting step runs behind its blocking load, and only it
    assert engine.adapters.stats.gpu_loads == len(names)


@pytest.mark.parametrize("mode", ["prefetch", "overlap"])
def test_requests_added_while_a_step_runs_start_loading_in_it(models, fleet, mode):
    """A server hands the engine requests that arrive mid-step (`step(on_idle=...)`). In
    prefetch mode their adapters start loading during that step, so the next step admits them
    with the adapter in its slot; other modes load at admission."""
    engine = fleet_engine(models, fleet, adapter_loading=mode, max_loras_per_batch=2)
    deadline = time.monotonic() + 30
    for name in ("ad0", "ad3"):  # in host memory: a load is a copy
        while not engine.adapters.prepare(name):
            assert time.monotonic() < deadline
            time.sleep(0.005)
    first = Request("a", PROMPTS[0], greedy(4), "ad0")
    late = Request("b", PROMPTS[1], greedy(3), "ad3")
    engine.add_request(first)
    assert engine.step() and first.output_token_ids  # prefilled: the next step is a decode
    calls = []

    def on_idle():
        calls.append(len(calls))
        if len(calls) == 1:
            engine.add_request(late)
            engine.prefetch_hint("ad4")  # a router's hint, mid-step too

    stats = engine.adapters.stats
    loads, prefetched, hits = stats.gpu_loads, stats.prefetch_loads, stats.hits
    engine.step(on_idle=on_idle)
    assert calls and late in engine.scheduler.waiting  # admitted no earlier than the next step
    prefetching = mode == "prefetch"
    assert engine.adapters.is_resident("ad3") == prefetching
    assert stats.prefetch_loads == prefetched + prefetching
    assert stats.gpu_loads == loads + prefetching
    if prefetching:  # the hint is queued behind the request's need; its disk read has begun
        manager = engine.adapters
        assert "ad4" in manager.queue
        assert "ad4" in manager.reader or "ad4" in manager.host
    while engine.has_work:
        engine.step()
        assert_slots_hold_their_adapters(engine)
    assert late.output_token_ids == hf_greedy(models["llama"], PROMPTS[1], 3, fleet["ad3"])
    assert first.output_token_ids == hf_greedy(models["llama"], PROMPTS[0], 4, fleet["ad0"])
    assert stats.hits == hits + (mode == "prefetch")  # admitted into the slot loaded mid-step


def test_a_disk_read_that_finishes_during_a_step_starts_its_copy_in_it(models, fleet):
    """Nothing new arrives, but a waiting request's disk read completes while a step runs: its
    copy starts then (prefetch mode), not at the next step boundary."""
    engine = fleet_engine(models, fleet, max_loras_per_batch=2)
    manager = engine.adapters
    gate, read = threading.Event(), manager.reader.read_file

    def gated_read(adapter, path):  # ad3's read ends when the test says
        if adapter == "ad3":
            assert gate.wait(30)
        return read(adapter, path)

    manager.reader.read_file = gated_read
    first = Request("a", PROMPTS[0], greedy(4), "ad0")
    late = Request("b", PROMPTS[1], greedy(3), "ad3")
    engine.add_request(first)
    engine.add_request(late)
    while not first.output_token_ids:  # ad0 read and loaded, "a" prefilled
        engine.step()
    assert manager.reader.reading() == ["ad3"] and not manager.is_resident("ad3")
    arrivals = manager.arrivals

    def on_idle():  # the read lands during this step
        gate.set()
        deadline = time.monotonic() + 30
        while not manager.reader.finished():
            assert time.monotonic() < deadline
            time.sleep(0.001)

    loads = manager.stats.prefetch_loads
    engine.step(on_idle=on_idle)
    assert manager.arrivals == arrivals  # no arrival: the finished read alone started the copy
    assert manager.is_resident("ad3") and manager.stats.prefetch_loads == loads + 1
    assert late in engine.scheduler.waiting
    while engine.has_work:
        engine.step()
    assert late.output_token_ids == hf_greedy(models["llama"], PROMPTS[1], 3, fleet["ad3"])


def test_disk_reads_run_one_at_a_time_soonest_need_first(models, fleet):
    """Reads share the host's bandwidth, so they take turns, and a turn goes to the soonest
    need, even one that showed up after the others."""
    engine = fleet_engine(models, fleet)
    manager = engine.adapters
    assert manager.reader.turns.workers == 1
    gate, read, started = threading.Event(), manager.reader.read_file, []

    def gated_read(adapter, path):
        started.append(adapter)
        assert gate.wait(30)
        return read(adapter, path)

    manager.reader.read_file = gated_read
    manager.reader.turns.clock = lambda: 0.0  # no read counts as stuck, however slow
    now = time.monotonic()
    manager.tick([("ad2", now + 3.0), ("ad1", now + 1.0)], now=now)
    manager.tick([("ad0", now + 0.5)], now=now)  # sooner than ad2, but ad1's read has begun
    assert manager.reader.reading() == ["ad1"]
    gate.set()
    deadline = time.monotonic() + 30
    while len(started) < 3 or manager.reader.reading():
        assert time.monotonic() < deadline, started
        manager.tick([], now=now)
        time.sleep(0.001)
    assert started == ["ad1", "ad0", "ad2"]
    assert all(manager.status()[name]["tier"] in ("gpu", "host") for name in started)


def test_a_read_stuck_on_its_file_does_not_hold_the_others(models, fleet, monkeypatch):
    """A file on a hung file system: once its read runs past READ_STALL_S, the next need's
    read starts and completes beside it."""
    engine = fleet_engine(models, fleet)
    manager = engine.adapters
    clock = [0.0]  # the read turns' clock: ad1's read runs past its stall time when moved
    monkeypatch.setattr(manager.reader.turns, "clock", lambda: clock[0])
    hung, read = threading.Event(), manager.reader.read_file

    def stuck_read(adapter, path):
        if adapter == "ad1":
            assert hung.wait(30)
        return read(adapter, path)

    manager.reader.read_file = stuck_read
    try:
        now = time.monotonic()
        manager.tick([("ad1", now), ("ad2", now + 1.0)], now=now)
        manager.tick([], now=now)
        assert manager.reader.reading() == ["ad1"]  # ad2 waits its turn...
        clock[0] += manager.reader.turns.stall_s
        deadline = time.monotonic() + 60  # a hang guard: ad2's read takes milliseconds
        while manager.status()["ad2"]["tier"] not in ("gpu", "host"):
            assert time.monotonic() < deadline
            manager.tick([], now=now)
            time.sleep(0.01)
        assert "ad1" in manager.reader  # ...until ad1's read counts as stuck (still running)
    finally:
        hung.set()


def test_mid_step_intake_takes_adds_and_hints_in_order_up_to_anything_else():
    """The server's engine thread takes requests and prefetch hints while a step runs, but stops
    at the first other inbox item: that item and everything after it wait for the step's end,
    in order (a request for an adapter loaded by a call just before it must come after it)."""
    from collections import deque

    from replicas.engine_loop import Abort, Add, Call, EngineLoop, Hints
    from replicas.protocol import GenerateRequest

    log = []

    class Recorder:
        def add_request(self, request):
            log.append(("add", request.request_id))

        def abort(self, request_id):
            log.append(("abort", request_id))

        def prefetch_hint(self, adapter, eta_s):
            log.append(("hint", adapter))

    class ListInbox:
        def __init__(self, items) -> None:
            self.items = deque(items)

        def get_nowait(self):
            return self.items.popleft() if self.items else None

        def wait(self, timeout_s: float) -> None:
            raise AssertionError("the test drives the inbox; nothing waits")

    inbox = ListInbox(
        [
            Add(GenerateRequest("r1", [1], greedy(1))),
            Hints([("x", 0.0), ("y", 0.1)]),
            Call(0, lambda e: log.append(("call", "load")), ()),
            Add(GenerateRequest("r2", [1], greedy(1), "loaded-by-the-call")),
            Abort("r1", None),
        ]
    )
    reports = []
    loop = EngineLoop(Recorder(), inbox, reports.append)  # not run: the test drives the inbox
    loop.take_intake()
    loop.take_intake()  # a held item stops every later mid-step intake too
    assert log == [("add", "r1"), ("hint", "x"), ("hint", "y")]
    loop.drain_inbox()
    assert log[3:] == [("call", "load"), ("add", "r2"), ("abort", "r1")]
