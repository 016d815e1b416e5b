"""Adapter management against a fleet of fake engine replicas: load and unload everywhere, undo
on partial failure, several ingress replicas agreeing, and the fleet-wide listing."""

from __future__ import annotations

import pytest

from replicas.errors import ErrorKind
from tests.app.conftest import BASE, FakeEngine, FakeReplica, make_client, text_chunks
from tests.app.test_routes import assert_openai_error
from tests.replicas.damaged_adapters import AT_INGRESS, damage


def fleet(*ids: str) -> FakeEngine:
    engine = FakeEngine(text_chunks("ok"))
    engine.replicas = [FakeReplica(i) for i in ids]
    return engine


async def load(client, name: str, path, **extra):
    return await client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra}
    )


async def unload(client, name: str):
    return await client.post("/v1/unload_lora_adapter", json={"lora_name": name})


async def complete(client, model: str):
    return await client.post("/v1/completions", json={"model": model, "prompt": "a"})


async def model_ids(client) -> set[str]:
    return {card["id"] for card in (await client.get("/v1/models")).json()["data"]}


def assert_consistent(engine: FakeEngine, name: str, *, loaded: bool) -> None:
    assert all((name in r.paths) == loaded for r in engine.replicas), [
        (r.replica_id, sorted(r.paths)) for r in engine.replicas
    ]


class TestLoadAdapter:
    async def test_loads_on_every_replica_and_serves_the_name(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter)
            models = await model_ids(client)
            done = await complete(client, "sql")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert r.text == "Success: LoRA adapter 'sql' added successfully."
        assert [rep.paths for rep in engine.replicas] == [{"sql": str(known_adapter)}] * 2
        assert "sql" in models
        assert done.status_code == 200, done.text
        assert engine.requests[-1].adapter == "sql"

    async def test_pinned_reaches_the_replicas(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter, pinned=True)
        assert r.status_code == 200, r.text
        assert all(rep.status["sql"]["pinned"] for rep in engine.replicas)

    async def test_a_relative_path_is_sent_absolute(self, tokenizer, known_adapter, monkeypatch):
        monkeypatch.chdir(known_adapter.parent)
        engine = fleet("r0")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter.name)
        assert r.status_code == 200, r.text
        assert engine.replicas[0].paths == {"sql": str(known_adapter)}

    async def test_partial_failure_is_undone_and_answered(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1", "r2")
        engine.replicas[1].reject_loads = ErrorKind.INVALID
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter)
            models = await model_ids(client)
            after = await complete(client, "sql")
        error = assert_openai_error(r, 400)
        assert "1 of 3" in error["message"] and "cannot read adapter" in error["message"]
        assert_consistent(engine, "sql", loaded=False)
        assert "sql" not in models
        assert_openai_error(after, 404)

    async def test_a_dead_replica_is_503_and_undone(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        engine.replicas[1].down = True
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter)
        error = assert_openai_error(r, 503)
        # Said without Ray's text, which names the actor, its process and class.
        assert "failed or is unavailable" in error["message"]
        for internal in ("actor_id", "4242", "10.0.0.7", "EngineDeployment"):
            assert internal not in error["message"], error
        assert "sql" not in engine.replicas[0].paths

    async def test_undo_leaves_an_adapter_of_the_same_name_loaded_by_another_alone(
        self, tokenizer, known_adapter, tmp_path
    ):
        # r1 already serves "sql" (loaded elsewhere; r0, which this ingress asks, does not).
        engine = fleet("r0", "r1")
        engine.replicas[1].load("sql", "/elsewhere/sql", False, "their-load")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter)
        error = assert_openai_error(r, 400)
        assert "already loaded" in error["message"]
        assert engine.replicas[0].paths == {}
        assert engine.replicas[1].paths == {"sql": "/elsewhere/sql"}

    @pytest.mark.parametrize(
        ("folder", "status", "words"),
        [
            ("too-big", 400, "max_lora_rank"),
            ("bin-only", 400, "pickle"),
            ("bad-json", 400, "not valid JSON"),
            ("no-config", 400, "adapter_config.json"),
            ("missing", 400, "runtime_adapter_dirs"),  # as any path it may not load from
        ],
    )
    async def test_bad_folder_is_refused_before_any_replica_sees_it(
        self, tokenizer, adapter_root, folder, status, words
    ):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "new", adapter_root / folder)
        error = assert_openai_error(r, status)
        assert words in error["message"] and error["param"] == "lora_path"
        assert_consistent(engine, "new", loaded=False)

    @pytest.mark.parametrize("kind", sorted(AT_INGRESS))
    async def test_a_broken_weights_file_is_400_before_any_replica_sees_it(
        self, tokenizer, known_adapter, tmp_path, kind
    ):
        bad = damage(known_adapter, tmp_path / kind, kind)
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "new", bad)
            models = await model_ids(client)
        error = assert_openai_error(r, 400)
        assert AT_INGRESS[kind] in error["message"] and error["param"] == "lora_path"
        assert_consistent(engine, "new", loaded=False)
        assert "new" not in models

    @pytest.mark.parametrize("name", ["sql-lora", "good", BASE])
    async def test_a_name_in_use_is_400(self, tokenizer, known_adapter, adapter_root, name):
        engine = fleet("r0")
        async with make_client(
            engine, tokenizer, adapters={"sql-lora": str(known_adapter)}, adapter_root=adapter_root
        ) as client:
            r = await load(client, name, adapter_root / "good")
        assert_openai_error(r, 400)
        assert engine.replicas[0].paths == {}

    async def test_loading_twice_is_400(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            first = await load(client, "sql", known_adapter)
            second = await load(client, "sql", known_adapter)
        assert first.status_code == 200
        error = assert_openai_error(second, 400)
        assert "already been loaded" in error["message"]
        assert_consistent(engine, "sql", loaded=True)

    @pytest.mark.parametrize("name", ["a/b", "", ".hidden", "x:y"])
    async def test_bad_names_are_400(self, tokenizer, known_adapter, name):
        async with make_client(fleet("r0"), tokenizer) as client:
            r = await load(client, name, known_adapter)
        assert assert_openai_error(r, 400)["param"] == "lora_name"

    async def test_missing_fields_are_400(self, tokenizer):
        async with make_client(fleet("r0"), tokenizer) as client:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert "lora_path" in assert_openai_error(r, 400)["message"]

    async def test_no_replica_running_is_503(self, tokenizer, known_adapter):
        engine = fleet()
        async with make_client(engine, tokenizer) as client:
            r = await load(client, "sql", known_adapter)
        assert_openai_error(r, 503)


class TestSeveralIngressReplicas:
    async def test_a_name_loaded_through_one_ingress_works_through_another(
        self, tokenizer, known_adapter
    ):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as a, make_client(engine, tokenizer) as b:
            assert_openai_error(await complete(b, "sql"), 404)
            assert (await load(a, "sql", known_adapter)).status_code == 200
            via_b = await complete(b, "sql")
            models_b = await model_ids(b)
        assert via_b.status_code == 200, via_b.text
        assert "sql" in models_b

    async def test_a_name_unloaded_through_one_ingress_is_404_through_another(
        self, tokenizer, known_adapter
    ):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as a, make_client(engine, tokenizer) as b:
            await load(a, "sql", known_adapter)
            assert (await complete(b, "sql")).status_code == 200
            assert (await unload(a, "sql")).status_code == 200
            refused = await complete(b, "sql")  # b still lists it; the engine answers 404
            again = await complete(b, "sql")  # now b knows
            models_b = await model_ids(b)
        assert_openai_error(refused, 404)
        assert_openai_error(again, 404)
        assert engine.requests[-1].adapter == "sql" and len(engine.requests) == 2
        assert "sql" not in models_b

    async def test_a_name_unloaded_elsewhere_leaves_the_models_list(self, tokenizer, known_adapter):
        engine = fleet("r0")
        async with (
            make_client(engine, tokenizer, adapters={"sql-lora": str(known_adapter)}) as a,
            make_client(engine, tokenizer, adapters={"sql-lora": str(known_adapter)}) as b,
        ):
            engine.replicas[0].paths["sql-lora"] = str(known_adapter)
            assert (await unload(a, "sql-lora")).status_code == 200
            models_b = await model_ids(b)
        assert "sql-lora" not in models_b


class TestUnloadAdapter:
    async def test_unloads_everywhere_and_new_requests_get_404(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            await load(client, "sql", known_adapter)
            r = await unload(client, "sql")
            after = await complete(client, "sql")
            models = await model_ids(client)
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'sql' removed successfully."
        assert_consistent(engine, "sql", loaded=False)
        assert_openai_error(after, 404, code="model_not_found")
        assert "sql" not in models
        assert engine.requests == []  # refused at the ingress, before any engine

    async def test_unknown_is_404(self, tokenizer):
        async with make_client(fleet("r0", "r1"), tokenizer) as client:
            r = await unload(client, "nope")
            bad_name = await unload(client, "a/b")
        assert "nope" in assert_openai_error(r, 404)["message"]
        assert_openai_error(bad_name, 404)

    async def test_the_base_model_cannot_be_unloaded(self, tokenizer):
        async with make_client(fleet("r0"), tokenizer) as client:
            r = await unload(client, BASE)
        assert_openai_error(r, 400)

    async def test_an_adapter_root_folder_stays_unloaded(self, tokenizer, adapter_root):
        engine = fleet("r0")
        engine.replicas[0].paths["good"] = str(adapter_root / "good")  # used once
        async with make_client(engine, tokenizer, adapter_root=adapter_root) as client:
            assert (await complete(client, "good")).status_code == 200
            assert (await unload(client, "good")).status_code == 200
            after = await complete(client, "good")
        assert_openai_error(after, 404)

    async def test_a_dead_replica_is_503_and_this_ingress_stops_sending(
        self, tokenizer, known_adapter
    ):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            await load(client, "sql", known_adapter)
            engine.replicas[1].down = True
            r = await unload(client, "sql")
            after = await complete(client, "sql")
        assert "1 of 2" in assert_openai_error(r, 503)["message"]
        assert "sql" not in engine.replicas[0].paths
        assert_openai_error(after, 404)

    async def test_unload_then_load_again(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            await load(client, "sql", known_adapter)
            await unload(client, "sql")
            again = await load(client, "sql", known_adapter)
            done = await complete(client, "sql")
        assert again.status_code == 200, again.text
        assert done.status_code == 200, done.text


class TestAdapterListing:
    async def test_every_adapter_with_its_tier_on_each_replica(
        self, tokenizer, known_adapter, adapter_root
    ):
        engine = fleet("r0", "r1")
        r0, r1 = engine.replicas
        for replica in engine.replicas:
            replica.paths["sql-lora"] = str(known_adapter)
        r0.status["sql-lora"] = {
            "tier": "gpu",
            "slot": 2,
            "rank": 8,
            "size_bytes": 4096,
            "pinned": False,
            "unloading": False,
        }
        r1.status["sql-lora"] = {
            "tier": "host",
            "slot": None,
            "rank": 8,
            "size_bytes": 4096,
            "pinned": False,
            "unloading": False,
        }
        async with make_client(
            engine, tokenizer, adapters={"sql-lora": str(known_adapter)}, adapter_root=adapter_root
        ) as client:
            await complete(client, "good")  # found under adapter_root
            await load(client, "runtime", adapter_root / "good")
            r = await client.get("/v1/adapters")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list"
        assert body["replicas"] == [
            {"replica_id": "r0", "available": True, "error": None},
            {"replica_id": "r1", "available": True, "error": None},
        ]
        cards = {card["id"]: card for card in body["data"]}
        assert set(cards) == {"sql-lora", "good", "runtime"}
        sql = cards["sql-lora"]
        assert sql == {
            "id": "sql-lora",
            "object": "adapter",
            "source": "config",
            "path": str(known_adapter),
            "rank": 8,
            "size_bytes": 4096,
            "pinned": False,
            "replicas": [
                {"replica_id": "r0", "tier": "gpu", "slot": 2},
                {"replica_id": "r1", "tier": "host", "slot": None},
            ],
        }
        good = cards["good"]
        assert (good["source"], good["rank"], good["size_bytes"]) == ("adapter_root", 4, None)
        assert [p["tier"] for p in good["replicas"]] == ["disk", "disk"]
        runtime = cards["runtime"]
        assert (runtime["source"], runtime["path"]) == ("runtime", str(adapter_root / "good"))
        assert [p["tier"] for p in runtime["replicas"]] == ["disk", "disk"]

    async def test_a_replica_that_does_not_answer_is_unavailable(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1", "r2")
        engine.replicas[1].down = True
        engine.replicas[2].slow = True
        engine.replicas[0].paths["sql-lora"] = str(known_adapter)
        engine.replicas[0].status["sql-lora"] = {
            "tier": "loading",
            "slot": 0,
            "rank": None,
            "size_bytes": None,
            "pinned": True,
            "unloading": False,
        }
        async with make_client(
            engine, tokenizer, adapters={"sql-lora": str(known_adapter)}
        ) as client:
            r = await client.get("/v1/adapters")
        assert r.status_code == 200, r.text
        body = r.json()
        states = body["replicas"]
        assert [s["available"] for s in states] == [True, False, False]
        assert states[1]["error"] == "the engine replica failed or is unavailable"
        assert states[1]["replica_id"] is None
        assert states[2] == {"replica_id": "r2", "available": False, "error": "too slow"}
        (card,) = body["data"]
        assert card["rank"] == 8  # from its config: no replica holds the weights yet
        assert card["pinned"] is True
        assert [p["tier"] for p in card["replicas"]] == ["loading", "unavailable", "unavailable"]

    async def test_an_adapter_missing_on_a_replica_is_absent_there(self, tokenizer, known_adapter):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer) as client:
            await load(client, "sql", known_adapter)
            engine.replicas[1] = FakeReplica("r1-restarted")  # lost what was loaded at run time
            r = await client.get("/v1/adapters")
        (card,) = r.json()["data"]
        assert [(p["replica_id"], p["tier"]) for p in card["replicas"]] == [
            ("r0", "disk"),
            ("r1-restarted", "absent"),
        ]

    async def test_no_replica_running(self, tokenizer):
        async with make_client(fleet(), tokenizer) as client:
            r = await client.get("/v1/adapters")
        assert r.status_code == 200
        assert r.json() == {"object": "list", "data": [], "replicas": []}
