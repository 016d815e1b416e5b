"""Adapter lifecycle through the app's routes over real engines: two engine replicas
(`EngineDeployment` built without Ray Serve, a tiny model on CPU) behind the fleet client, and
adapters written by PEFT.

Unloading a name while requests use it never wedges it: the name is free at once, the running
requests finish on the old weights (PEFT's outputs), a reload serves the new ones, and once the
app is quiet `/v1/adapters`, `/v1/models`, each replica's served names, its slot gauge and the
next request all agree with a model of what was loaded.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from app.adapters import FleetView
from app.fleet import ReplicaReply, ServeFleetClient
from replicas.adapter_ledger import MemoryLedger
from replicas.config import EngineConfig
from replicas.deployment import EngineDeployment, EngineMetrics
from replicas.protocol import GenerateChunk, GenerateRequest
from tests.app.conftest import BASE, FakeMetricsBackend, make_client
from tests.app.test_management import load, unload
from tests.app.test_routes import assert_openai_error
from tests.engines import GatedEngine
from tests.factories import hf_greedy, make_adapter, make_model
from tests.replicas.damaged_adapters import AT_ENGINE, damage

PROMPT = [5, 17, 200, 33]
MAX_TOKENS = 6
SLOTS = 2


class LocalFleet:
    """The app's `EngineClient` over in-process engine replicas: broadcasts reach every replica,
    requests go round robin, and each request's token ids are kept by request id."""

    def __init__(self, replicas: list[EngineDeployment]) -> None:
        self.replicas = replicas
        self.tokens: dict[str, list[int]] = {}
        self._turn = itertools.count()

    async def info(self) -> dict:
        return await self.replicas[0].info()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        replica = self.replicas[next(self._turn) % len(self.replicas)]
        tokens = self.tokens.setdefault(request.request_id, [])
        stream = aiter(replica.generate(request))
        try:
            async for chunk in stream:
                tokens += chunk.token_ids
                yield chunk
        finally:
            await stream.aclose()  # closing this stream early aborts the request

    async def served_adapters(self) -> FleetView:
        answer = await self.replicas[0].served_adapters()
        return FleetView(dict(answer["adapters"]), frozenset(answer["unloaded"]))

    async def broadcast_load_adapter(self, name, path, pinned, load_id) -> list[ReplicaReply]:
        return await self._broadcast(lambda r: r.load_adapter(name, path, pinned, load_id))

    async def broadcast_unload_adapter(self, name, load_id=None) -> list[ReplicaReply]:
        return await self._broadcast(lambda r: r.unload_adapter(name, load_id))

    async def adapter_reports(self, timeout_s: float) -> list[ReplicaReply]:
        replies = await self._broadcast(lambda r: r.adapter_report(timeout_s))
        return [ReplicaReply(r.value["replica_id"], r.value) if r.ok else r for r in replies]

    async def _broadcast(self, call) -> list[ReplicaReply]:
        answers = await asyncio.gather(*(call(r) for r in self.replicas), return_exceptions=True)
        return [
            ReplicaReply(error=a) if isinstance(a, BaseException) else ReplicaReply(value=a)
            for a in answers
        ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model, two adapters of different weights, and PEFT's greedy tokens for each."""
    root = tmp_path_factory.mktemp("lifecycle")
    model = make_model(root / "model")
    adapters = {
        key: make_adapter(model, root / key, rank=8, target_modules=targets, seed=seed)
        for key, targets, seed in (("A", ["q_proj", "v_proj"], 1), ("B", ["o_proj", "up_proj"], 2))
    }
    expected = {key: hf_greedy(model, PROMPT, MAX_TOKENS, path) for key, path in adapters.items()}
    assert expected["A"] != expected["B"], "the adapters must be told apart by their outputs"
    return model, adapters, expected


@pytest.fixture
async def app(files, tokenizer):
    model, _, _ = files
    backends = [FakeMetricsBackend() for _ in range(2)]
    config = EngineConfig(
        model=str(model), num_kv_blocks=64, block_size=4, max_lora_rank=8, max_loras_per_batch=SLOTS
    )
    replicas = [
        EngineDeployment.func_or_class(config, engine_cls=GatedEngine, metrics=EngineMetrics(b))
        for b in backends
    ]
    for i, replica in enumerate(replicas):
        replica.replica_id = f"r{i}"
    fleet = LocalFleet(replicas)
    async with make_client(fleet, tokenizer) as client:
        yield client, fleet, backends
    for replica in replicas:
        replica.__del__()  # what Serve's teardown runs: stops its tasks and the engine


async def complete(client, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return await client.post("/v1/completions", json={**body, "ignore_eos": True})


async def until(condition, timeout_s: float = 60.0):
    """Poll `condition` until it returns something truthy, and return that. The deadline only
    turns a hang into a failure: what is waited for is bound to happen, so it is generous."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if result := await condition():
            return result
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


async def assert_converged(client, fleet: LocalFleet, backends, loaded: dict[str, str]) -> None:
    """Once nothing runs: every view of the fleet agrees that exactly `loaded` (name -> folder)
    is served, and no slot or weights of an unloaded version are left behind."""

    async def idle() -> bool:
        stats = [await r.stats() for r in fleet.replicas]
        return all(s["num_running"] == s["num_waiting"] == 0 for s in stats)

    await until(idle)  # aborted requests included
    listing = (await client.get("/v1/adapters")).json()
    cards = {card["id"]: card for card in listing["data"]}
    assert set(cards) == set(loaded), listing
    for name, card in cards.items():
        assert card["path"] == loaded[name]
        assert {p["replica_id"] for p in card["replicas"]} == {"r0", "r1"}
        assert all(p["tier"] in ("gpu", "loading", "host", "disk") for p in card["replicas"])
    models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
    assert models == {BASE, *loaded}
    for replica, backend in zip(fleet.replicas, backends, strict=True):
        served = await replica.served_adapters()
        assert served["adapters"] == loaded
        status = await replica.adapters()
        assert not [n for n, s in status.items() if s["unloading"]], status
        stats = await replica.stats()
        resident = stats["resident_adapters"]
        assert len(resident) <= SLOTS
        assert {key.split("#")[0] for key in resident} <= set(loaded), resident
        assert len({key.split("#")[0] for key in resident}) == len(resident)  # one version each
        await replica.report_stats()
        assert backend["lorafleet_adapter_slots_used"].records[-1][0] == len(resident)


async def test_load_request_unload_reload_a_hundred_times(app, files):
    """The wedge's recipe, load -> request -> unload -> reload, with the request still in flight
    when the unload comes (the engines hold it queued, or running with its first token out, in
    turn): every unload leaves the old version in use, every reload succeeds and every request
    gets its version's tokens."""
    client, fleet, backends = app
    _, adapters, expected = files
    keys = ["A", "B"]

    async def hold(state: str) -> None:
        for replica in fleet.replicas:
            await replica.engine.call(GatedEngine.set_hold, state)

    assert (await load(client, "x", adapters["A"])).status_code == 200
    for i in range(100):
        state = ("queued", "started")[i % 2]
        await hold(state)
        running = asyncio.create_task(complete(client, "x"))

        async def placed(state=state) -> EngineDeployment | None:
            for replica in fleet.replicas:
                if await replica.engine.call(GatedEngine.held_requests, state):
                    return replica
            return None

        replica = await until(placed)  # and held there until the engines open
        assert (r := await unload(client, "x")).status_code == 200, r.text
        status = (await replica.adapters())["x"]
        assert status["unloading"], (i, state, status)  # the request keeps the old version
        r = await load(client, "x", adapters[keys[(i + 1) % 2]])
        assert r.status_code == 200, (i, r.text)
        await hold("open")
        done = await running
        assert done.status_code == 200, done.text
        assert fleet.tokens[done.json()["id"]] == expected[keys[i % 2]], (i, state)
    last = await complete(client, "x")
    assert fleet.tokens[last.json()["id"]] == expected["A"]
    await assert_converged(client, fleet, backends, {"x": str(adapters["A"])})


async def test_random_loads_unloads_requests_and_aborts_agree_with_a_model(app, files):
    """Seeded rounds of concurrent tasks: at most one load or unload per name and round, and
    requests (some abandoned mid-stream) on any name. Each management answer is the model's;
    a request gets 404 or the tokens of a version its name had during the round; after each
    round every view agrees with the model."""
    client, fleet, backends = app
    _, adapters, expected = files
    rng = random.Random(20261127)
    names = ["a", "b", "c"]
    state: dict[str, str | None] = dict.fromkeys(names)  # name -> adapter key, None: absent
    seen: Counter[str] = Counter()  # what the rounds exercised

    async def manage(name: str, op: str, key: str | None, delay: float) -> None:
        await asyncio.sleep(delay)  # so that some requests reach the engines first
        before = state[name]
        if op == "load":
            r = await load(client, name, adapters[key])
            if before is None:
                assert r.status_code == 200, r.text
                state[name] = key
            else:
                assert "already been loaded" in assert_openai_error(r, 400)["message"]
        else:
            r = await unload(client, name)
            if before is not None:
                assert r.status_code == 200, r.text
                state[name] = None
            else:
                assert_openai_error(r, 404)

    async def request(name: str, allowed: set[str | None], abandon_after: float | None) -> None:
        call = asyncio.create_task(complete(client, name))
        if abandon_after is not None:
            await asyncio.sleep(abandon_after)
            call.cancel()
        try:
            r = await call
        except asyncio.CancelledError:
            seen["abandoned"] += 1
            return
        seen[f"{r.status_code} while changing" if len(allowed) > 1 else str(r.status_code)] += 1
        if r.status_code == 404:
            assert None in allowed, (name, allowed)
        else:
            assert r.status_code == 200, r.text
            got = fleet.tokens[r.json()["id"]]
            assert got in [expected[k] for k in allowed if k is not None], (name, allowed)

    for _ in range(20):
        ops = {}
        for name in names:
            op = rng.choice(["load", "unload", None])
            if op is not None:
                ops[name] = (op, rng.choice(["A", "B"]), rng.choice([0.0, 0.01, 0.03, 0.06]))
        tasks = []
        for _ in range(5):
            name = rng.choice(names)
            allowed = {state[name]}  # what the name serves now, and after its change if any
            op, key, _ = ops.get(name, (None, None, None))
            if op == "load" and state[name] is None:
                allowed.add(key)
            elif op == "unload" and state[name] is not None:
                allowed.add(None)
            abandon = rng.choice([None, None, None, 0.0, 0.02])
            tasks.append(request(name, allowed, abandon))
        tasks += [manage(name, *op) for name, op in ops.items()]
        rng.shuffle(tasks)
        await asyncio.gather(*tasks)
        loaded = {n: str(adapters[k]) for n, k in state.items() if k is not None}
        await assert_converged(client, fleet, backends, loaded)
    assert all(seen[k] >= 3 for k in ("200", "404", "200 while changing", "abandoned")), seen
    for name, key in state.items():  # the next request agrees too
        r = await complete(client, name)
        if key is None:
            assert_openai_error(r, 404)
        else:
            assert fleet.tokens[r.json()["id"]] == expected[key]


@pytest.mark.parametrize("kind", sorted(AT_ENGINE))
async def test_an_adapter_that_does_not_fit_the_model_is_400_at_load(app, files, tmp_path, kind):
    """What the ingress cannot check without the model (in/out sizes, layer count) the engine
    replicas refuse at load: 400 naming the tensor, and nothing loaded anywhere."""
    client, fleet, backends = app
    _, adapters, _ = files
    bad = damage(adapters["A"], tmp_path / kind, kind)
    r = await load(client, "x", bad)
    error = assert_openai_error(r, 400)
    assert AT_ENGINE[kind] in error["message"] and "2 of 2" in error["message"], error
    assert_openai_error(await complete(client, "x"), 404)
    await assert_converged(client, fleet, backends, {})


class ReplicasHandle:
    """A deployment handle over in-process replicas: `broadcast` calls each one concurrently,
    as Serve does, for `ServeFleetClient`, each after a random delay of its own (over the
    network, two broadcasts may reach two replicas in opposite orders)."""

    def __init__(self, replicas: list[EngineDeployment], rng: random.Random) -> None:
        self.replicas = replicas
        self.rng = rng
        self.turn = itertools.count()

    def __getattr__(self, method: str):  # handle.<method>.remote(): one replica, round robin
        replicas = self.replicas

        class Method:
            def remote(self, *args):
                replica = replicas[next(handle.turn) % len(replicas)]
                return getattr(replica, method)(*args)

        handle = self
        return Method()

    def broadcast(self, method: str, *args):
        async def call(replica, delay: float):
            await asyncio.sleep(delay)
            return await getattr(replica, method)(*args)

        calls = [call(r, self.rng.choice([0.0, 0.002, 0.01])) for r in self.replicas]

        class Results:
            async def results_async(self, timeout_s: float, return_exceptions: bool):
                return await asyncio.gather(*calls, return_exceptions=return_exceptions)

        return Results()


class ServedFleet(LocalFleet):
    """`LocalFleet` whose control plane is the app's own `ServeFleetClient`, with the fleet's
    ledger: what several ingress replicas of one app share."""

    def __init__(
        self, replicas: list[EngineDeployment], ledger: MemoryLedger, rng: random.Random
    ) -> None:
        super().__init__(replicas)
        self.control = ServeFleetClient(ReplicasHandle(replicas, rng), ledger=ledger)

    async def served_adapters(self) -> FleetView:
        return await self.control.served_adapters()

    async def broadcast_load_adapter(self, name, path, pinned, load_id) -> list[ReplicaReply]:
        return await self.control.broadcast_load_adapter(name, path, pinned, load_id)

    async def broadcast_unload_adapter(self, name, load_id=None) -> list[ReplicaReply]:
        return await self.control.broadcast_unload_adapter(name, load_id)


async def test_loads_and_unloads_of_one_name_through_two_ingresses_converge(files, tokenizer):
    """Two ingress replicas race loads and unloads of the same names (each ingress serializes
    only its own), and their broadcasts reach the replicas in either order. Once the replicas
    have caught up with the ledger (as they do every few seconds) the fleet is in one state:
    both replicas serve the same adapters, the ledger says so (a replica started now would
    serve them too), and both ingresses' /v1/models, /v1/adapters and next requests agree."""
    model, adapters, expected = files
    ledger = MemoryLedger()
    backends = [FakeMetricsBackend() for _ in range(2)]
    config = EngineConfig(
        model=str(model), num_kv_blocks=64, block_size=4, max_lora_rank=8, max_loras_per_batch=SLOTS
    )
    replicas = [
        EngineDeployment.func_or_class(config, metrics=EngineMetrics(b), ledger=ledger)
        for b in backends
    ]
    for i, replica in enumerate(replicas):
        replica.replica_id = f"r{i}"
    rng = random.Random(7)
    fleets = [ServedFleet(replicas, ledger, rng) for _ in range(2)]
    names = ["x", "y"]
    outcomes: Counter[str] = Counter()
    caught_up = 0  # replicas the ledger's catch-up changed (broadcasts that crossed)
    try:
        async with (
            make_client(fleets[0], tokenizer) as one,
            make_client(fleets[1], tokenizer) as two,
        ):
            ingresses = [one, two]

            async def change(client, name: str, delay: float) -> None:
                await asyncio.sleep(delay)
                if rng.random() < 0.6:
                    key = rng.choice(["A", "B"])
                    r = await load(client, name, adapters[key])
                    outcomes[f"load {r.status_code}"] += 1
                else:
                    r = await unload(client, name)
                    outcomes[f"unload {r.status_code}"] += 1
                assert r.status_code in (200, 400, 404), r.text

            for _ in range(25):
                tasks = [
                    change(client, rng.choice(names), rng.choice([0.0, 0.0, 0.001, 0.005]))
                    for client in ingresses
                    for _ in range(rng.randint(1, 2))
                ]
                await asyncio.gather(*tasks)
                for replica in replicas:  # the catch-up each replica runs every few seconds
                    caught_up += bool(await replica.sync_adapters())
                served = [(await r.served_adapters())["adapters"] for r in replicas]
                assert served[0] == served[1], served
                fleet_says = {
                    name: entry.path
                    for name, entry in ledger.read_all().items()
                    if entry.path is not None
                }
                assert fleet_says == served[0], (fleet_says, served)
                for client in ingresses:
                    models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
                    assert models == {BASE, *served[0]}, (models, served)
                    listing = (await client.get("/v1/adapters")).json()["data"]
                    assert {card["id"]: card["path"] for card in listing} == served[0], listing
                    for name in names:
                        r = await complete(client, name)
                        if name not in served[0]:
                            assert_openai_error(r, 404)
                            continue
                        key = next(k for k, p in adapters.items() if str(p) == served[0][name])
                        assert (
                            fleets[0].tokens.get(
                                r.json()["id"], fleets[1].tokens.get(r.json()["id"])
                            )
                            == expected[key]
                        )
    finally:
        for replica in replicas:
            replica.__del__()
    # The races happened: both answers of each route, loads refused as taken included.
    assert all(outcomes[k] > 0 for k in ("load 200", "load 400", "unload 200", "unload 404"))
