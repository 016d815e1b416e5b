"""A seeded random workload through the engine on CPU, against transformers + PEFT.

Requests arrive between steps (base and several adapters, prompts spanning several prefill
chunks), some are aborted, a KV pool too small for them all forces preemptions, and adapter
names are unloaded at run time (some in use, which then finish on the weights they started with)
and loaded again, on the same or another adapter's files. Every request that completes has
exactly PEFT's greedy tokens; an aborted one has a prefix of them and frees its blocks at once;
in the end every KV block and adapter slot is free.

Adapter reads run on a pool the test drives (`ReadsInTurns`): each lands a seeded number of loop
turns after it starts, so reads are in flight across steps as on the reader's threads, but at the
same steps in every run. With real threads the workload depended on how fast the machine read,
and so did what it did (its preemptions, aborts and swaps, checked at the end).
"""

import random
from concurrent.futures import Future

import pytest

from replicas.adapters.modes import LOADING_MODES
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind
from replicas.request import Request
from tests.factories import LORA_MODULES
from tests.replicas.conftest import greedy, make_engine, peft_greedy_table, write_adapters

NUM_REQUESTS = 30
MAX_TOKENS = 8  # references are this long; a request asks for 1..MAX_TOKENS
MAX_MODEL_LEN = 40  # the longest prompt and output fit; the cache holds 56 tokens
CHUNK = 8  # token budget per step: longer prompts take several prefill chunks
PROMPTS = [
    random.Random(100 + i).choices(range(3, 259), k=n) for i, n in enumerate([3, 9, 14, 21, 26])
]
ADAPTERS = {
    "qv-r2": dict(rank=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(
        rank=8,
        lora_alpha=16,
        target_modules=LORA_MODULES,
        use_rslora=True,
    ),
    "mlp-r4": dict(rank=4, lora_alpha=4, target_modules=["gate_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def folders(models, tmp_path_factory):
    return write_adapters(models["llama"], tmp_path_factory.mktemp("random"), ADAPTERS, 40)


@pytest.fixture(scope="module")
def expected(models, folders):
    """(adapter folder key or None, prompt index) -> PEFT's first MAX_TOKENS greedy tokens."""
    return peft_greedy_table(models["llama"], folders, PROMPTS, MAX_TOKENS)


def assert_residency_is_status(engine) -> None:
    """The router's view (`residency`, built for speed) is `status`'s tiers, retired left out."""
    tiers: dict[str, list[str]] = {"gpu": [], "loading": [], "host": []}
    for name, status in engine.adapters.status().items():
        if status["tier"] in tiers and not status["unloading"]:
            tiers[status["tier"]].append(name)
    assert engine.adapters.residency() == tiers


class ReadsInTurns:
    """The adapter reader's pool (`AdapterReader._pool`), run by the test: a read submitted
    lands (runs, and its future is set) at the 1st to 4th call of `turn()`, drawn from `rng`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: list[list] = []  # [turns left, future, fn, args]

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.pending.append([self.rng.randint(0, 3), future, fn, args])
        return future

    def turn(self) -> None:
        for read in list(self.pending):
            read[0] -= 1
            if read[0] >= 0:
                continue
            self.pending.remove(read)
            _, future, fn, args = read
            try:
                future.set_result(fn(*args))
            except Exception as e:
                future.set_exception(e)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.pending.clear()


def assert_blocks_accounted(engine) -> None:
    """Every KV block is free or owned by exactly one unfinished request."""
    owned = [b for r in engine.scheduler.requests() for b in r.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) + engine.blocks.num_free == engine.blocks.num_blocks, "a block leaked"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_matches_peft(models, folders, expected, seed):
    rng = random.Random(seed)
    mode = sorted(LOADING_MODES)[seed % len(LOADING_MODES)]
    engine = make_engine(
        models["llama"],
        adapters=tuple((k, str(v)) for k, v in folders.items()),
        adapter_loading=mode,
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_num_seqs=6,
        max_num_batched_tokens=CHUNK,
        num_kv_blocks=14,  # 56 tokens: two long requests fill it
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        kv_reserve_ratio=0.0,  # admit whenever a chunk fits: running requests get preempted
    )
    reads = engine.adapters.reader._pool = ReadsInTurns(random.Random(seed + 100))
    engine.adapters.reader.turns.clock = lambda: 0.0  # no read ever counts as stuck
    served = {name: name for name in folders}  # served name -> the folder it reads
    requests: dict[str, tuple[Request, str | None, int]] = {}  # id -> (request, folder, prompt)
    tokens: dict[str, list[int]] = {}
    finished, aborted = set(), set()
    swaps = 0  # names unloaded while requests used them, then loaded on another adapter's files

    def arrive() -> None:
        name = rng.choice([None, *served])
        p = rng.randrange(len(PROMPTS))
        rid = f"r{len(requests)}"
        request = Request(rid, PROMPTS[p], greedy(rng.randint(1, MAX_TOKENS)), name)
        engine.add_request(request)
        requests[rid] = (request, served.get(name), p)
        tokens[rid] = []

    def abort() -> None:
        live = [rid for rid, (r, _, _) in requests.items() if not r.is_finished]
        if not live:
            return
        rid = rng.choice(live)
        request = requests[rid][0]
        held, free = len(request.block_table), engine.blocks.num_free
        assert engine.abort(rid) is not None
        assert request.block_table == [] and engine.blocks.num_free == free + held
        aborted.add(rid)

    def unload_and_reload() -> None:
        nonlocal swaps
        name = rng.choice(sorted(served))
        in_use = any(r.adapter == name and not r.is_finished for r, _, _ in requests.values())
        engine.unload_adapter(name)
        old = served.pop(name)
        with pytest.raises(RequestRejected) as refused:
            engine.add_request(Request("refused", PROMPTS[0], greedy(1), name))
        assert refused.value.kind is ErrorKind.NOT_FOUND
        # The same name again, on its own files or another adapter's: requests queued before
        # finish on the old weights, those from now on get the new ones.
        folder = rng.choice(sorted(folders))
        engine.load_adapter(name, str(folders[folder]))
        swaps += in_use and folder != old
        served[name] = folder

    for _ in range(10_000):  # under a hundred turns drain it; more is a livelock
        if len(requests) >= NUM_REQUESTS and not engine.has_work:
            break
        if len(requests) < NUM_REQUESTS:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                arrive()
        if rng.random() < 0.1:
            abort()
        if rng.random() < 0.08:
            unload_and_reload()
        for out in engine.step():
            assert out.request_id not in finished and out.request_id not in aborted
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason == "length", out
                finished.add(out.request_id)
        assert_blocks_accounted(engine)
        assert_residency_is_status(engine)
        reads.turn()
    else:
        raise AssertionError("the engine did not drain")

    for rid, (request, folder, p) in requests.items():
        want = expected[folder, p]
        if rid in aborted:
            assert tokens[rid] == want[: len(tokens[rid])], rid
        else:
            assert rid in finished, rid
            assert tokens[rid] == want[: request.sampling.max_tokens], (rid, folder, p)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.adapters.slots.num_held == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # The workload did what it is here for.
    assert engine.num_preemptions > 0
    assert aborted and swaps and len(finished) >= 12  # swaps: in-use names reloaded
    assert engine.stats().adapter_gpu_loads > len(folders)
