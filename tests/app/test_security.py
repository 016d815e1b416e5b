"""The HTTP front under hostile or careless clients: the API key, the folders run-time loads may
name, the body limit, an event loop that stays free while a long prompt is tokenized, and
client mistakes that must be a 400 in OpenAI's body, never a 500 or internals."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx
import pytest

from app.api import ApiSettings, make_api
from app.guards import default_body_limit
from app.metrics import IngressMetrics
from replicas.protocol import GenerateChunk, GenerateRequest
from tests.app.conftest import (
    BASE,
    FakeEngine,
    FakeMetricsBackend,
    make_client,
    text_chunks,
    write_adapter,
)
from tests.app.test_routes import assert_openai_error

KEY = "sk-test-0123456789"
JSON = {"content-type": "application/json"}


async def load(client, name: str, path, **kwargs):
    return await client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, **kwargs
    )


class TestApiKey:
    async def test_without_a_key_configured_the_routes_are_open(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.get("/v1/models")
        assert r.status_code == 200

    @pytest.mark.parametrize(
        "headers",
        [
            {},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": f"Bearer {KEY[:-1]}"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
            {"X-Api-Key": KEY},
        ],
    )
    async def test_every_v1_route_needs_the_key(self, tokenizer, headers):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer, api_key=KEY) as client:
            answers = [
                await client.get("/v1/models", headers=headers),
                await client.get("/v1/adapters", headers=headers),
                await client.get("/v1/nothing", headers=headers),
                await client.post(
                    "/v1/completions", json={"model": BASE, "prompt": "a"}, headers=headers
                ),
                await client.post(
                    "/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=headers
                ),
            ]
        for r in answers:
            error = assert_openai_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert KEY not in error["message"]
        assert engine.requests == []

    async def test_the_key_opens_them_and_health_needs_none(self, tokenizer):
        engine = FakeEngine(text_chunks("ok"))
        auth = {"Authorization": f"Bearer {KEY}"}
        async with make_client(engine, tokenizer, api_key=KEY) as client:
            models = await client.get("/v1/models", headers=auth)
            done = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a"}, headers=auth
            )
            health = await client.get("/health")
        assert models.status_code == 200 and done.status_code == 200, done.text
        assert health.status_code == 200

    async def test_the_key_is_checked_before_the_body_is_read(self, tokenizer):
        # Over the body limit and without the key: 401, so a client without the key cannot
        # make the server read (or even measure) a large body.
        async with make_client(
            FakeEngine(), tokenizer, api_key=KEY, max_request_body_bytes=1024
        ) as client:
            r = await client.post("/v1/completions", content=b"x" * 4096)
        assert_openai_error(r, 401)


class TestRuntimeAdapterDirs:
    @pytest.fixture
    def allowed(self, tmp_path, lora_model_dir):
        """A folder run-time loads may use, with one adapter in it."""
        folder = tmp_path / "allowed"
        write_adapter(lora_model_dir, folder / "sql")
        return folder

    async def test_loading_is_off_by_default(self, tokenizer, allowed):
        engine = FakeEngine()
        async with make_client(engine, tokenizer, runtime_adapter_dirs=()) as client:
            r = await load(client, "sql", allowed / "sql")
        error = assert_openai_error(r, 403)
        assert "runtime_adapter_dirs" in error["message"]
        assert engine.replicas[0].paths == {}

    async def test_a_folder_inside_loads_under_its_real_path(self, tokenizer, allowed, tmp_path):
        (tmp_path / "link").symlink_to(allowed, target_is_directory=True)
        engine = FakeEngine(text_chunks("ok"))
        dirs = (str(tmp_path / "link"),)  # the allowed folder itself may be a symlink
        async with make_client(engine, tokenizer, runtime_adapter_dirs=dirs) as client:
            r = await load(client, "sql", tmp_path / "link" / "sql")
        assert r.status_code == 200, r.text
        assert engine.replicas[0].paths == {"sql": str(allowed / "sql")}

    async def test_every_other_path_gets_the_same_answer(
        self, tokenizer, allowed, tmp_path, lora_model_dir
    ):
        outside = write_adapter(lora_model_dir, tmp_path / "outside")
        (allowed / "escape").symlink_to(outside, target_is_directory=True)
        (allowed / "file").write_text("{}")
        paths = [
            outside,  # a valid adapter, outside
            allowed / "escape",  # a symlink inside, to a folder outside
            allowed / ".." / "outside",  # a way out through ".."
            allowed / "missing",
            allowed / "file",  # not a folder
            "/",
            "/root",
            "/root/.ssh",
            "/etc/passwd",
            "~",
            "~no-such-user-here/x",
            "",
            "a\0b",
            "/" + "a" * 300,  # a component longer than the file system allows
            "/x" * 600_000,  # 1.2 MB
        ]
        engine = FakeEngine()
        async with make_client(engine, tokenizer, runtime_adapter_dirs=(str(allowed),)) as c:
            answers = [await load(c, f"n{i}", path) for i, path in enumerate(paths)]
        for r in answers:
            assert assert_openai_error(r, 400)["param"] == "lora_path"
        assert len({r.text for r in answers}) == 1, {r.text for r in answers}
        assert engine.replicas[0].paths == {}

    async def test_a_folder_inside_that_is_not_an_adapter_says_why(self, tokenizer, allowed):
        (allowed / "empty").mkdir()
        async with make_client(
            FakeEngine(), tokenizer, runtime_adapter_dirs=(str(allowed),)
        ) as client:
            r = await load(client, "empty", allowed / "empty")
        assert "adapter_config.json" in assert_openai_error(r, 400)["message"]


class TestBodyLimit:
    LIMIT = 4096

    def _body(self, size: int) -> bytes:
        prefix = b'{"model": "' + BASE.encode() + b'", "max_tokens": 1, "prompt": "'
        return prefix + b"a" * (size - len(prefix) - 2) + b'"}'

    async def test_a_declared_size_over_the_limit_is_413_before_reading(self, tokenizer):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer, max_request_body_bytes=self.LIMIT) as client:
            r = await client.post(
                "/v1/completions", content=self._body(self.LIMIT + 1), headers=JSON
            )
        error = assert_openai_error(r, 413, code="request_too_large")
        assert "max_request_body_bytes" in error["message"]
        assert engine.requests == []

    async def test_a_chunked_body_is_cut_off_at_the_limit(self, tokenizer):
        sent = []

        async def chunks():
            for _ in range(100):
                sent.append(1)
                yield b"a" * 1024

        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer, max_request_body_bytes=self.LIMIT) as client:
            r = await client.post("/v1/completions", content=chunks())
        assert_openai_error(r, 413)
        assert len(sent) <= self.LIMIT // 1024 + 1  # read no further than the limit
        assert engine.requests == []

    async def test_bodies_up_to_the_limit_pass_chunked_or_not(self, tokenizer):
        body = self._body(self.LIMIT)

        async def chunks():
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer, max_request_body_bytes=self.LIMIT) as client:
            plain = await client.post("/v1/completions", content=body, headers=JSON)
            chunked = await client.post("/v1/completions", content=chunks(), headers=JSON)
        # The prompt is longer than the fake engine's context: the route read and parsed it.
        assert_openai_error(plain, 400, code="context_length_exceeded")
        assert_openai_error(chunked, 400, code="context_length_exceeded")

    def test_the_context_length_comes_from_the_model_when_not_configured(self, tmp_path):
        from app.ingress import model_context_length

        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
        assert model_context_length(tmp_path) == 8192
        nested = {"text_config": {"max_position_embeddings": 4096}}
        (tmp_path / "config.json").write_text(json.dumps(nested))
        assert model_context_length(tmp_path) == 4096
        (tmp_path / "config.json").write_text("{not json")
        assert model_context_length(tmp_path) is None
        assert model_context_length(tmp_path / "missing") is None

    def test_the_default_limit_holds_a_full_context_of_escaped_text(self):
        settings = ApiSettings(served_model_name=BASE, model_root="/m", max_model_len=8192)
        assert settings.body_limit == default_body_limit(8192) == 2**20 + 32 * 8192
        # A full context of emoji (a token or more each), each escaped as a surrogate pair.
        assert len(json.dumps("\U0001f600" * 8192)) < settings.body_limit


class BlockingTokenizer:
    """The byte tokenizer, except that encoding a text of `long` characters or more waits until
    `release` is set: a tokenization that takes as long as the test wants. `timeout_s` only
    bounds a wait the test never released (it failed first), so it is generous."""

    def __init__(self, inner, *, long: int, timeout_s: float = 60.0) -> None:
        self._inner = inner
        self._long = long
        self._timeout_s = timeout_s
        self.entered = threading.Event()
        self.release = threading.Event()
        self.done = threading.Event()

    def encode(self, text, **kwargs):
        if len(text) < self._long:
            return self._inner.encode(text, **kwargs)
        self.entered.set()
        self.release.wait(self._timeout_s)
        try:
            return self._inner.encode(text, **kwargs)
        finally:
            self.done.set()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class TestEventLoopStaysFree:
    async def test_health_and_a_short_request_answer_while_a_long_prompt_is_tokenized(
        self, tokenizer
    ):
        slow = BlockingTokenizer(tokenizer, long=20_000)
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, slow) as client:
            long = asyncio.create_task(
                client.post("/v1/completions", json={"model": BASE, "prompt": "x" * 20_000})
            )
            try:
                assert await asyncio.to_thread(slow.entered.wait, 60.0)  # a hang guard
                health = await client.get("/health")
                short = await client.post("/v1/completions", json={"model": BASE, "prompt": "hi"})
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"model": BASE, "messages": [{"role": "user", "content": "hi"}]},
                )
                answered_while_blocked = not slow.done.is_set()
            finally:
                slow.release.set()
            refused = await long
        assert answered_while_blocked
        assert health.status_code == 200
        assert short.status_code == 200 and chat.status_code == 200, (short.text, chat.text)
        # The long prompt was tokenized, then refused: longer than the context.
        assert_openai_error(refused, 400, code="context_length_exceeded")


class TestClientMistakes:
    @pytest.mark.parametrize(
        ("route", "body"),
        [
            ("/v1/completions", {"model": BASE, "prompt": "a\ud800b"}),
            ("/v1/completions", {"model": BASE, "prompt": "a", "stop": ["\udfff"]}),
            ("/v1/completions", {"model": "a\ud800", "prompt": "a"}),
            (
                "/v1/chat/completions",
                {"model": BASE, "messages": [{"role": "user", "content": "a\ud800b"}]},
            ),
            (
                "/v1/chat/completions",
                {
                    "model": BASE,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
                },
            ),
            (
                "/v1/chat/completions",
                {
                    "model": BASE,
                    "messages": [{"role": "user", "content": "a"}],
                    "chat_template_kwargs": {"x": {"\ud800": 1}},
                },
            ),
            ("/v1/load_lora_adapter", {"lora_name": "a\ud800", "lora_path": "/x"}),
            ("/v1/unload_lora_adapter", {"lora_name": "\ud800"}),
        ],
    )
    async def test_a_lone_surrogate_is_400(self, tokenizer, route, body):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer) as client:
            # JSON escapes, "\ud800", as json.dumps writes them (no UTF-8 encoder takes them raw).
            content = json.dumps(body).encode()
            r = await client.post(route, content=content, headers=JSON)
        error = assert_openai_error(r, 400)
        assert "surrogate" in error["message"]
        assert engine.requests == []

    @pytest.mark.parametrize(
        ("route", "body", "param"),
        [
            ("/v1/completions", {"model": BASE, "prompt": [[False]]}, "prompt"),
            ("/v1/completions", {"model": BASE, "prompt": [5, 1.0]}, "prompt"),
            ("/v1/completions", {"model": BASE, "prompt": "a", "max_tokens": "5"}, "max_tokens"),
            ("/v1/completions", {"model": BASE, "prompt": "a", "stream": 1}, "stream"),
            (
                "/v1/chat/completions",
                {"model": BASE, "messages": [{"role": "user", "content": "a"}], "seed": True},
                "seed",
            ),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 5}, "lora_path"),
        ],
    )
    async def test_a_value_of_another_type_is_400_not_coerced(self, tokenizer, route, body, param):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post(route, json=body)
        error = assert_openai_error(r, 400)
        assert error["param"].split(".")[0] == param, error  # a union names its first member
        assert engine.requests == []

    @pytest.mark.parametrize("depth", [40, 900])
    async def test_deeply_nested_template_variables_are_400(self, tokenizer, depth):
        nested = "[" * depth + "]" * depth
        body = (
            f'{{"model": "{BASE}", "messages": [{{"role": "user", "content": "a"}}], '
            f'"chat_template_kwargs": {{"x": {nested}}}}}'
        )
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/chat/completions", content=body.encode(), headers=JSON)
        assert "nested deeper" in assert_openai_error(r, 400)["message"]
        assert engine.requests == []

    @pytest.mark.parametrize(
        ("seed", "status"), [(2**63 - 1, 200), (-(2**63), 200), (2**63, 400), (2**64, 400)]
    )
    async def test_seeds_are_64_bit_signed_integers(self, tokenizer, seed, status):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "seed": seed}
            )
        if status == 200:
            assert r.status_code == 200, r.text
            assert engine.requests[0].sampling.seed == seed
        else:
            assert assert_openai_error(r, 400)["param"] == "seed"

    @pytest.mark.parametrize("token_id", [-1, 259, 2**70])
    async def test_stop_token_ids_outside_the_vocabulary_are_400(self, tokenizer, token_id):
        engine = FakeEngine(text_chunks("ok"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post(
                "/v1/completions",
                json={"model": BASE, "prompt": "a", "stop_token_ids": [10, token_id]},
            )
            ok = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stop_token_ids": [258]}
            )
        assert assert_openai_error(r, 400)["param"] == "stop_token_ids"
        assert ok.status_code == 200

    @pytest.mark.parametrize("key", ["chat_template", "tokenize", "return_dict"])
    async def test_template_kwargs_cannot_replace_the_template_or_the_call(self, tokenizer, key):
        body = {
            "model": BASE,
            "messages": [{"role": "user", "content": "a"}],
            "chat_template_kwargs": {key: "{% for i in range(10**9) %}x{% endfor %}"},
        }
        async with make_client(FakeEngine(text_chunks("ok")), tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=body)
        assert key in assert_openai_error(r, 400)["message"]

    async def test_over_long_names_are_400_or_404(self, tokenizer, adapter_root):
        async with make_client(FakeEngine(), tokenizer, adapter_root=adapter_root) as client:
            model = await client.post(
                "/v1/completions", json={"model": "m" * 1_000_000, "prompt": "a"}
            )
            name = await load(client, "n" * 300, adapter_root / "good")
        assert_openai_error(model, 404)
        assert assert_openai_error(name, 400)["param"] == "lora_name"

    async def test_not_json_is_400_in_openais_body(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/completions", content=b"\xff\xfe not json", headers=JSON)
        assert_openai_error(r, 400)


class DeadReplicaEngine(FakeEngine):
    """An engine whose replica dies under the request: the handle raises what Ray raises."""

    def __init__(self, *, after_chunks: int) -> None:
        super().__init__(text_chunks("ab"))
        self.after_chunks = after_chunks

    async def generate(self, request: GenerateRequest):
        for _ in range(self.after_chunks):
            yield GenerateChunk(request.request_id, list(b"ab"), None, 1)
        raise RuntimeError(
            f"The actor died unexpectedly before finishing this task. class_name: "
            f"EngineDeployment actor_id: 8f3e5a01 pid: {os.getpid()} ip: 10.0.0.7"
        )


class TestEngineFailures:
    @pytest.mark.parametrize("stream", [False, True])
    async def test_a_replica_dying_before_the_first_token_is_503_without_internals(
        self, tokenizer, stream
    ):
        async with make_client(DeadReplicaEngine(after_chunks=0), tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stream": stream}
            )
        error = assert_openai_error(r, 503)
        assert "engine replica" in error["message"]
        for internal in ("actor", "pid", "EngineDeployment", "10.0.0.7", "RuntimeError"):
            assert internal not in r.text

    async def test_a_replica_dying_mid_stream_is_an_error_event_without_internals(self, tokenizer):
        async with make_client(DeadReplicaEngine(after_chunks=2), tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stream": True}
            )
        assert r.status_code == 200
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' in r.text and "engine replica" in r.text
        for internal in ("actor", "pid", "EngineDeployment", "10.0.0.7", "RuntimeError"):
            assert internal not in r.text

    @pytest.mark.parametrize("after_chunks", [0, 2])
    async def test_through_the_serve_handle_ray_errors_say_nothing_of_the_replica(
        self, tokenizer, after_chunks, monkeypatch
    ):
        from ray.exceptions import ActorDiedError

        from app.engine_client import ServeEngineClient

        # Asked outside an actor, Ray starts a local cluster (seconds of both cores) to answer.
        monkeypatch.setattr("app.fleet.caller_id", lambda: "ingress-actor")

        class Died(ActorDiedError):
            def __str__(self):
                return (
                    "The actor died unexpectedly. class_name: EngineDeployment, actor_id: "
                    "8f3e5a01, pid: 4242, ip: 10.0.0.7"
                )

        handle = FakeHandle(after_chunks, Died())
        settings = ApiSettings(served_model_name=BASE, model_root="/m")
        api = make_api(
            ServeEngineClient(handle),
            tokenizer,
            settings,
            metrics=IngressMetrics(FakeMetricsBackend()),
        )
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stream": True}
            )
        if after_chunks == 0:
            assert "engine replica" in assert_openai_error(r, 503)["message"]
        else:
            assert r.status_code == 200 and '"error"' in r.text and "engine replica" in r.text
        for internal in ("actor", "pid", "EngineDeployment", "10.0.0.7", "Died"):
            assert internal not in r.text

    async def test_an_unexpected_fault_is_a_json_500_without_internals(self, tokenizer):
        class Broken(FakeEngine):
            async def info(self):
                return {"max_model_len": "not a number", "vocab_size": 3}

        settings = ApiSettings(served_model_name=BASE, model_root="/m")
        api = make_api(Broken(), tokenizer, settings, metrics=IngressMetrics(FakeMetricsBackend()))
        # Starlette answers, then re-raises for the server to log: don't raise it here.
        transport = httpx.ASGITransport(app=api, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": "a"})
        error = assert_openai_error(r, 500)
        assert "not a number" not in error["message"] and "ValueError" not in r.text


class FakeHandle:
    """A handle to the engine deployment whose replica dies after `after_chunks` chunks: its
    streamed response raises `error`, as Ray's does."""

    def __init__(self, after_chunks: int, error: BaseException) -> None:
        self.after_chunks = after_chunks
        self.error = error
        self.generate = _Method(self._generate)
        self.info = _Method(self._info)

    def options(self, **_):
        return self

    async def _info(self):
        return {"max_model_len": 64, "eos_token_ids": [257], "vocab_size": 259}

    def _generate(self, request: GenerateRequest, *_):
        return _Streamed(self._chunks(request))

    async def _chunks(self, request: GenerateRequest):
        for i in range(self.after_chunks):
            yield GenerateChunk(request.request_id, list(b"ab"), None, 1, start=2 * i)
        raise self.error


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class _Streamed:
    def __init__(self, chunks) -> None:
        self._chunks = chunks

    def __aiter__(self):
        return self._chunks

    def cancel(self) -> None:
        pass
