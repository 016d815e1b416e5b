"""Hub adapters at the ingress, against a local hub (tests/hub_server) and fake engine replicas:
served on a request's first use or loaded through /v1/load_lora_adapter, gated by
`hub_adapter_repos`, pinned to one commit for the whole fleet, and every failure answered with
its status in OpenAI's body."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import AppArgs
from app.hub import pin_configured_adapters
from replicas.adapters.hub import HubAccess
from replicas.errors import ErrorKind
from replicas.protocol import EngineError
from tests.app.conftest import FakeEngine, FakeReplica, make_client, text_chunks, write_adapter
from tests.app.test_routes import assert_openai_error
from tests.hub_server import FakeHub

ALLOWED = ("myorg/*",)


@pytest.fixture
def hub(tmp_path, lora_model_dir, monkeypatch):
    server = FakeHub().start()
    server.shas = {
        "sql": server.push_folder("myorg/sql-lora", write_adapter(lora_model_dir, tmp_path / "a")),
        "big": server.push_folder(
            "myorg/big-lora", write_adapter(lora_model_dir, tmp_path / "b", rank=64)
        ),
        "other": server.push_folder("other/sql-lora", tmp_path / "a"),
    }
    server.push("myorg/weights-only", {"model.safetensors": b"x", "config.json": b"{}"})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield server
    server.stop()


def fleet(*ids: str) -> FakeEngine:
    engine = FakeEngine(text_chunks("ok"))
    engine.replicas = [FakeReplica(i) for i in ids]
    return engine


async def complete(client, model: str):
    return await client.post("/v1/completions", json={"model": model, "prompt": "a"})


async def load(client, name: str, path: str):
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def no_cache_path(response, hub_cache) -> None:
    assert str(hub_cache) not in response.text and "snapshots" not in response.text


class TestFirstRequest:
    async def test_an_allowed_hub_adapter_is_pinned_and_served_by_every_replica(
        self, tokenizer, hub
    ):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            r = await complete(client, "myorg/sql-lora")
            models = (await client.get("/v1/models")).json()["data"]
            listing = (await client.get("/v1/adapters")).json()["data"]
        assert r.status_code == 200, r.text
        assert engine.requests[-1].adapter == "myorg/sql-lora"
        pinned = f"hf://myorg/sql-lora@{hub.shas['sql']}"
        assert [rep.paths for rep in engine.replicas] == [{"myorg/sql-lora": pinned}] * 2
        assert {"id": "myorg/sql-lora", "root": pinned} in [
            {"id": m["id"], "root": m["root"]} for m in models
        ]
        card = next(c for c in listing if c["id"] == "myorg/sql-lora")
        assert (card["source"], card["path"], card["rank"]) == ("hub", pinned, 4)

    async def test_concurrent_first_requests_share_one_look_up_and_one_load(self, tokenizer, hub):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            answers = await asyncio.gather(*(complete(client, "myorg/sql-lora") for _ in range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert hub.requests["api"] == 1
        assert all(len(rep.load_ids) == 1 for rep in engine.replicas)

    async def test_two_ingress_replicas_at_once_end_with_one_pin_everywhere(self, tokenizer, hub):
        engine = fleet("r0", "r1")
        async with (
            make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as a,
            make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as b,
        ):
            answers = await asyncio.gather(
                complete(a, "myorg/sql-lora"), complete(b, "myorg/sql-lora")
            )
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        pinned = f"hf://myorg/sql-lora@{hub.shas['sql']}"
        assert [rep.paths for rep in engine.replicas] == [{"myorg/sql-lora": pinned}] * 2

    async def test_a_revision_is_its_own_name_pinned_to_its_commit(self, tokenizer, hub):
        engine = fleet("r0")
        name = f"myorg/sql-lora@{hub.shas['sql']}"
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            r = await complete(client, name)
        assert r.status_code == 200, r.text
        assert engine.replicas[0].paths == {name: f"hf://{name}"}

    @pytest.mark.parametrize(
        ("repos", "model"),
        [((), "myorg/sql-lora"), (ALLOWED, "other/sql-lora"), (ALLOWED, "myorg")],
    )
    async def test_a_repo_not_allowed_is_an_unknown_model_and_the_hub_is_not_asked(
        self, tokenizer, hub, repos, model
    ):
        async with make_client(fleet("r0"), tokenizer, hub_adapter_repos=repos) as client:
            r = await complete(client, model)
        assert_openai_error(r, 404)
        assert r.json()["error"]["code"] == "model_not_found"
        assert sum(hub.requests.values()) == 0

    @pytest.mark.parametrize(
        ("model", "status", "says"),
        [
            ("myorg/nothing", 404, "no repo myorg/nothing"),
            ("myorg/sql-lora@no-such-branch", 404, "no revision 'no-such-branch'"),
            ("myorg/weights-only", 400, "not a PEFT LoRA adapter"),
            ("myorg/big-lora", 400, "above max_lora_rank"),
        ],
    )
    async def test_what_the_hub_cannot_serve_is_answered_with_its_reason(
        self, tokenizer, hub, tmp_path, model, status, says
    ):
        engine = fleet("r0")
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            r = await complete(client, model)
        assert_openai_error(r, status)
        message = r.json()["error"]["message"]
        assert model in message and says in message
        no_cache_path(r, tmp_path / "hf-cache")
        assert engine.replicas[0].paths == {} and not engine.requests

    async def test_a_hub_that_does_not_answer_is_503_with_retry_after(self, tokenizer, hub):
        hub.stall_api()
        settings = {"hub_adapter_repos": ALLOWED, "hub_timeout_s": 0.3}
        async with make_client(fleet("r0"), tokenizer, **settings) as client:
            r = await complete(client, "myorg/sql-lora")
            health = await client.get("/health")  # the event loop was never blocked
        assert_openai_error(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        assert health.status_code == 200
        hub.release()

    async def test_an_unloaded_hub_adapter_is_not_fetched_again(self, tokenizer, hub):
        engine = fleet("r0")
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            assert (await complete(client, "myorg/sql-lora")).status_code == 200
            unloaded = await client.post(
                "/v1/unload_lora_adapter", json={"lora_name": "myorg/sql-lora"}
            )
            again = await complete(client, "myorg/sql-lora")
        assert unloaded.status_code == 200, unloaded.text
        assert_openai_error(again, 404)


class TestLoadFromHub:
    async def test_lora_path_hf_loads_the_pinned_commit_everywhere(self, tokenizer, hub):
        engine = fleet("r0", "r1")
        async with make_client(engine, tokenizer, hub_adapter_repos=ALLOWED) as client:
            r = await load(client, "sql", "hf://myorg/sql-lora")
            done = await complete(client, "sql")
        assert r.status_code == 200, r.text
        pinned = f"hf://myorg/sql-lora@{hub.shas['sql']}"
        assert [rep.paths for rep in engine.replicas] == [{"sql": pinned}] * 2
        assert done.status_code == 200

    @pytest.mark.parametrize(
        ("repos", "path", "status"),
        [
            ((), "hf://myorg/sql-lora", 403),
            (ALLOWED, "hf://other/sql-lora", 400),
            (ALLOWED, "hf://not a repo", 400),
            (ALLOWED, "hf://myorg/nothing", 404),
            (ALLOWED, "hf://myorg/weights-only", 400),
        ],
    )
    async def test_refusals(self, tokenizer, hub, tmp_path, repos, path, status):
        engine = fleet("r0")
        async with make_client(engine, tokenizer, hub_adapter_repos=repos) as client:
            r = await load(client, "sql", path)
        assert_openai_error(r, status)
        assert r.json()["error"]["param"] == "lora_path"
        no_cache_path(r, tmp_path / "hf-cache")
        assert engine.replicas[0].paths == {}


async def test_every_503_tells_the_client_when_to_retry(tokenizer):
    engine = FakeEngine(
        error=EngineError("the engine replica failed; retry", ErrorKind.UNAVAILABLE)
    )
    async with make_client(engine, tokenizer) as client:
        r = await complete(client, "tiny-base")
    assert_openai_error(r, 503)
    assert r.headers["Retry-After"] == "1"


class TestConfigured:
    def test_hub_ids_are_pinned_and_folders_made_absolute(self, hub, tmp_path):
        configured = {
            "sql": "myorg/sql-lora",
            "v": "hf://myorg/sql-lora@main",
            "local": str(tmp_path / "a"),
        }
        pinned = pin_configured_adapters(configured, 16, HubAccess.from_env())
        commit = f"hf://myorg/sql-lora@{hub.shas['sql']}"
        assert pinned == {"sql": commit, "v": commit, "local": str(tmp_path / "a")}

    def test_an_adapter_the_hub_cannot_serve_fails_the_build_naming_it(self, hub):
        with pytest.raises(ValueError, match=r"adapter 'big'.*above max_lora_rank"):
            pin_configured_adapters({"big": "myorg/big-lora"}, 16, HubAccess.from_env())

    @pytest.mark.parametrize("pattern", ["myorg", "a/b/c", "my org/*"])
    def test_repo_patterns_are_checked(self, pattern):
        with pytest.raises(ValueError, match="pattern over hub repo ids"):
            AppArgs(hub_adapter_repos=[pattern])

    def test_the_engine_gets_the_hub_limits(self, tmp_path):
        args = AppArgs(model=str(tmp_path), max_hub_adapter_gib=0.5, hub_timeout_s=7)
        config = args.to_engine_config(tmp_path, "cpu")
        assert (config.max_hub_adapter_bytes, config.hub_timeout_s) == (2**29, 7)
        assert json.dumps(args.hub_adapter_repos) == "[]"
