"""The HTTP routes against a fake engine: response shapes, model resolution, errors, aborts."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from app.api import ApiSettings, make_api
from app.metrics import IngressMetrics
from replicas.errors import ErrorKind
from replicas.protocol import EngineError
from tests.app.conftest import (
    BASE,
    MAX_MODEL_LEN,
    FakeEngine,
    FakeMetricsBackend,
    make_client,
    sse_events,
    text_chunks,
)


def assert_openai_error(response, status: int, *, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


class TestCompletions:
    async def test_non_streaming_returns_text_and_usage(self, tokenizer):
        engine = FakeEngine(text_chunks("Hel", "lo!"), finish_reason="length")
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": "abc"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["id"].startswith("cmpl-")
        assert body["model"] == BASE
        assert body["choices"] == [
            {"index": 0, "text": "Hello!", "logprobs": None, "finish_reason": "length"}
        ]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        request = engine.requests[0]
        assert request.request_id == body["id"]
        assert request.prompt_token_ids == list(b"abc")
        assert request.adapter is None
        assert request.sampling.max_tokens == 16  # OpenAI's default for completions

    async def test_streaming_sends_chunks_then_done(self, tokenizer):
        engine = FakeEngine(text_chunks("Hel", "lo"), finish_reason="stop")
        async with make_client(engine, tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "abc", "stream": True}
            )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello"
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]

    async def test_streaming_usage_chunk_when_asked(self, tokenizer):
        engine = FakeEngine(text_chunks("ab", "c"))
        payload = {
            "model": BASE,
            "prompt": "xy",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        *text_events, usage_event = events[:-1]
        assert all(e["usage"] is None for e in text_events)
        assert usage_event["choices"] == []
        assert usage_event["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 3,
            "total_tokens": 5,
        }

    @pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3]], ["\x01\x02\x03"]])
    async def test_prompt_forms(self, tokenizer, prompt):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": prompt})
        assert r.status_code == 200, r.text
        assert engine.requests[0].prompt_token_ids == [1, 2, 3]

    async def test_sampling_fields_reach_the_engine(self, tokenizer):
        engine = FakeEngine(text_chunks("x"))
        payload = {
            "model": BASE,
            "prompt": "a",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 7,
            "ignore_eos": True,
            "stop_token_ids": [10],
        }
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        sampling = engine.requests[0].sampling
        assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (5, 0.0, 0.5)
        assert (sampling.top_k, sampling.seed, sampling.ignore_eos) == (3, 7, True)
        assert sampling.stop_token_ids == (10,)

    async def test_stop_string_ends_the_text_and_aborts_the_engine(self, tokenizer):
        engine = FakeEngine(text_chunks("Hello wo", "rld and more", " tokens"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stop": ["world"]}
            )
        choice = r.json()["choices"][0]
        assert choice == {"index": 0, "text": "Hello ", "logprobs": None, "finish_reason": "stop"}
        assert engine.aborted == [engine.requests[0].request_id]

    async def test_streamed_stop_string_never_leaks(self, tokenizer):
        engine = FakeEngine(text_chunks("ab", "c<", "/s", "> tail", " more"))
        payload = {"model": BASE, "prompt": "a", "stop": "</s>", "stream": True}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        events = sse_events(r.text)
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert "".join(texts) == "abc"
        assert all("<" not in t for t in texts)
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert engine.aborted == [engine.requests[0].request_id]

    async def test_multibyte_character_split_across_chunks(self, tokenizer):
        euro = "€".encode()
        engine = FakeEngine([[euro[0]], [euro[1]], [euro[2], ord("!")]])
        payload = {"model": BASE, "prompt": "a", "stream": True}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        texts = [e["choices"][0]["text"] for e in sse_events(r.text)[:-1]]
        assert texts == ["€!"]
        assert all("\ufffd" not in t for t in texts)


class TestChatCompletions:
    async def test_non_streaming_shape_and_template(self, tokenizer):
        engine = FakeEngine(text_chunks("Hi", " there"), finish_reason="stop")
        payload = {
            "model": BASE,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            ],
            "max_completion_tokens": 8,
        }
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        assert body["choices"] == [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi there"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ]
        request = engine.requests[0]
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokenizer.decode(request.prompt_token_ids) == expected
        assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len("Hi there")
        assert request.sampling.max_tokens == 8

    async def test_max_tokens_defaults_to_the_rest_of_the_context(self, tokenizer):
        engine = FakeEngine(text_chunks("x"))
        payload = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        assert r.status_code == 200, r.text
        request = engine.requests[0]
        assert request.sampling.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)

    async def test_streaming_role_then_deltas_then_done(self, tokenizer):
        engine = FakeEngine(text_chunks("Hi", " you"), finish_reason="stop")
        payload = {
            "model": BASE,
            "messages": [{"role": "user", "content": "hey"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        first, *middle, last, usage = events[:-1]
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [e["choices"][0]["delta"] for e in [*middle, last]]
        assert "".join(d.get("content", "") for d in deltas) == "Hi you"
        assert last["choices"][0]["finish_reason"] == "stop"
        assert all(e["choices"][0]["finish_reason"] is None for e in [first, *middle])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6

    async def test_tokenizer_without_chat_template_is_a_400(self, tokenizer):
        no_template = tokenizer.__class__(
            tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|eos|>"
        )
        engine = FakeEngine(text_chunks("x"))
        payload = {"model": BASE, "messages": [{"role": "user", "content": "hey"}]}
        async with make_client(engine, no_template) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        error = assert_openai_error(r, 400)
        assert "chat template" in error["message"]
        assert engine.requests == []

    async def test_image_content_is_refused(self, tokenizer):
        payload = {
            "model": BASE,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        }
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        error = assert_openai_error(r, 400)
        assert "only text content" in error["message"]


class TestModelResolution:
    @pytest.mark.parametrize(
        ("model", "adapter"),
        [(BASE, None), ("sql-lora", "sql-lora"), (f"{BASE}:sql-lora", "sql-lora")],
    )
    async def test_configured_names(self, tokenizer, known_adapter, model, adapter):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(
            engine, tokenizer, adapters={"sql-lora": str(known_adapter)}
        ) as client:
            r = await client.post("/v1/completions", json={"model": model, "prompt": "a"})
        assert r.status_code == 200, r.text
        assert engine.requests[0].adapter == adapter
        assert r.json()["model"] == model

    @pytest.mark.parametrize("model", ["nope", f"{BASE}:nope", f"{BASE}:", "other:sql-lora"])
    async def test_unknown_model_is_404(self, tokenizer, known_adapter, model):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(
            engine, tokenizer, adapters={"sql-lora": str(known_adapter)}
        ) as client:
            r = await client.post("/v1/completions", json={"model": model, "prompt": "a"})
        error = assert_openai_error(r, 404, code="model_not_found")
        assert error["param"] == "model"
        assert engine.requests == []

    async def test_models_lists_base_and_adapters(self, tokenizer, known_adapter):
        async with make_client(
            FakeEngine(), tokenizer, adapters={"sql-lora": str(known_adapter)}
        ) as client:
            r = await client.get("/v1/models")
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "list"
        cards = {card["id"]: card for card in body["data"]}
        assert cards[BASE]["parent"] is None
        assert cards[BASE]["root"] == "/models/tiny-base"
        assert cards["sql-lora"]["parent"] == BASE
        assert cards["sql-lora"]["root"] == str(known_adapter)
        assert all(card["object"] == "model" for card in cards.values())

    async def test_adapter_root_discovered_on_first_use(self, tokenizer, adapter_root):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(engine, tokenizer, adapter_root=adapter_root) as client:
            before = {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
            r = await client.post("/v1/completions", json={"model": "good", "prompt": "a"})
            after = {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
            r2 = await client.post("/v1/completions", json={"model": f"{BASE}:good", "prompt": "a"})
        assert r.status_code == 200, r.text
        assert r2.status_code == 200, r2.text
        assert [req.adapter for req in engine.requests] == ["good", "good"]
        assert before == {BASE}
        assert after == {BASE, "good"}

    @pytest.mark.parametrize(
        ("name", "words"),
        [
            ("no-config", "adapter_config.json"),
            ("too-big", "max_lora_rank"),
            ("bin-only", "pickle"),
            ("bad-json", "not valid JSON"),
        ],
    )
    async def test_invalid_adapter_in_root_is_a_clear_400(
        self, tokenizer, adapter_root, name, words
    ):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(engine, tokenizer, adapter_root=adapter_root) as client:
            bad = await client.post("/v1/completions", json={"model": name, "prompt": "a"})
            good = await client.post("/v1/completions", json={"model": "good", "prompt": "a"})
            models = {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
        error = assert_openai_error(bad, 400)
        assert words in error["message"]
        assert name in error["message"]
        assert good.status_code == 200, good.text
        assert [req.adapter for req in engine.requests] == ["good"]
        assert name not in models

    @pytest.mark.parametrize("name", ["missing", "..", ".hidden", "a\\b"])
    async def test_names_that_are_not_folders_of_the_root_are_404(
        self, tokenizer, adapter_root, name
    ):
        async with make_client(FakeEngine(), tokenizer, adapter_root=adapter_root) as client:
            r = await client.post("/v1/completions", json={"model": name, "prompt": "a"})
        assert_openai_error(r, 404, code="model_not_found")

    async def test_a_fixed_adapter_folder_is_picked_up(self, tokenizer, adapter_root):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(engine, tokenizer, adapter_root=adapter_root) as client:
            first = await client.post("/v1/completions", json={"model": "bad-json", "prompt": "a"})
            good_config = (adapter_root / "good" / "adapter_config.json").read_text()
            (adapter_root / "bad-json" / "adapter_config.json").write_text(good_config)
            second = await client.post("/v1/completions", json={"model": "bad-json", "prompt": "a"})
        assert first.status_code == 400
        assert second.status_code == 200, second.text


class TestErrors:
    async def test_malformed_json_is_an_openai_400(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post(
                "/v1/completions",
                content=b'{"model": "tiny-base", "prompt": ',
                headers={"content-type": "application/json"},
            )
        error = assert_openai_error(r, 400)
        assert "JSON" in error["message"]

    async def test_missing_field_names_it(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE})
        error = assert_openai_error(r, 400)
        assert error["param"] == "prompt"

    @pytest.mark.parametrize(
        ("field", "value", "words"),
        [
            ("temperature", -1.0, "temperature"),
            ("top_p", 0.0, "top_p"),
            ("max_tokens", 0, "max_tokens"),
            ("top_k", -5, "top_k"),
        ],
    )
    async def test_bad_sampling_params_are_400(self, tokenizer, field, value, words):
        engine = FakeEngine(text_chunks("x"))
        async with make_client(engine, tokenizer) as client:
            r = await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", field: value}
            )
        error = assert_openai_error(r, 400)
        assert words in error["message"]
        assert engine.requests == []

    @pytest.mark.parametrize(
        ("extra", "words"),
        [
            ({"n": 2}, "n=1"),
            ({"prompt": ["a", "b"]}, "batched prompts"),
            ({"prompt": [[1], [2]]}, "batched prompts"),
            ({"echo": True}, "echo"),
            ({"logprobs": 1}, "logprobs"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
            ({"stream_options": {"include_usage": True}}, "stream"),
        ],
    )
    async def test_unsupported_options_are_400(self, tokenizer, extra, words):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": "a", **extra})
        error = assert_openai_error(r, 400)
        assert words in error["message"]

    async def test_prompt_longer_than_the_context_is_400(self, tokenizer):
        engine = FakeEngine(text_chunks("x"))
        prompt = "a" * (MAX_MODEL_LEN + 1)
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": prompt})
        error = assert_openai_error(r, 400, code="context_length_exceeded")
        assert str(MAX_MODEL_LEN) in error["message"]
        assert str(MAX_MODEL_LEN + 1) in error["message"]
        assert error["param"] == "prompt"
        assert engine.requests == []

    async def test_chat_longer_than_the_context_is_400(self, tokenizer):
        engine = FakeEngine(text_chunks("x"))
        payload = {"model": BASE, "messages": [{"role": "user", "content": "a" * MAX_MODEL_LEN}]}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/chat/completions", json=payload)
        error = assert_openai_error(r, 400, code="context_length_exceeded")
        assert error["param"] == "messages"
        assert engine.requests == []

    async def test_empty_prompt_is_400(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": ""})
        error = assert_openai_error(r, 400)
        assert "empty" in error["message"]

    async def test_prompt_plus_max_tokens_over_the_context_is_400(self, tokenizer):
        engine = FakeEngine(text_chunks("x"))
        payload = {"model": BASE, "prompt": "a" * 60, "max_tokens": 10}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        error = assert_openai_error(r, 400, code="context_length_exceeded")
        for number in (MAX_MODEL_LEN, 60, 10, 70):
            assert str(number) in error["message"]
        assert engine.requests == []

    async def test_token_ids_outside_the_vocabulary_are_400(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.post("/v1/completions", json={"model": BASE, "prompt": [1, 100000]})
        error = assert_openai_error(r, 400)
        assert "100000" in error["message"]

    @pytest.mark.parametrize("stream", [False, True])
    async def test_engine_refusal_keeps_its_status(self, tokenizer, stream):
        engine = FakeEngine(error=EngineError("overloaded", ErrorKind.UNAVAILABLE))
        payload = {"model": BASE, "prompt": "a", "stream": stream}
        async with make_client(engine, tokenizer) as client:
            r = await client.post("/v1/completions", json=payload)
        error = assert_openai_error(r, 503)
        assert error["message"] == "overloaded"
        assert error["type"] == "ServiceUnavailableError"

    async def test_engine_error_after_streaming_began_is_an_sse_event_without_internals(
        self, tokenizer, caplog
    ):
        engine = FakeEngine(
            text_chunks("ab", "cd"),
            error=EngineError("internal engine error: CUDA device lost", ErrorKind.INTERNAL),
            error_after=1,
        )
        payload = {"model": BASE, "prompt": "a", "stream": True}
        serve_logger = logging.getLogger("ray.serve")  # Ray's; it does not propagate
        serve_logger.addHandler(caplog.handler)
        try:
            async with make_client(engine, tokenizer) as client:
                r = await client.post("/v1/completions", json=payload)
        finally:
            serve_logger.removeHandler(caplog.handler)
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[0]["choices"][0]["text"] == "ab"
        error = events[-2]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "InternalServerError"
        assert "failed" in error["message"] and "CUDA" not in error["message"]
        assert "CUDA device lost" in caplog.text  # the operator still learns what happened
        assert events[-1] == "[DONE]"

    async def test_unknown_route_is_an_openai_404(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.get("/v1/nothing")
        assert_openai_error(r, 404)

    async def test_health(self, tokenizer):
        async with make_client(FakeEngine(), tokenizer) as client:
            r = await client.get("/health")
        assert r.status_code == 200


def _asgi_scope(path: str, spec_version: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }


def _settings() -> ApiSettings:
    return ApiSettings(served_model_name=BASE, model_root="/models/tiny-base")


# What the ASGI calls below are given at most: each ends within milliseconds, so the bound only
# turns a hang (a disconnect that is never noticed) into a failure.
HANG_S = 60


class TestClientDisconnect:
    """Closing the HTTP stream must close the engine stream, which aborts the request."""

    async def test_disconnect_while_the_engine_is_generating(self, tokenizer):
        engine = FakeEngine(text_chunks("Hello"), hang=True)
        backend = FakeMetricsBackend()
        api = make_api(engine, tokenizer, _settings(), metrics=IngressMetrics(backend))
        body = json.dumps({"model": BASE, "prompt": "a", "stream": True}).encode()
        first_text_sent = asyncio.Event()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> dict:
            message = next(messages, None)
            if message is not None:
                return message
            await first_text_sent.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                first_text_sent.set()

        await asyncio.wait_for(api(_asgi_scope("/v1/completions", "2.3"), receive, send), HANG_S)
        assert len(engine.requests) == 1
        assert engine.aborted == [engine.requests[0].request_id]
        # The tokens it was sent are counted though it never finished (counted at its close).
        assert backend["lorafleet_output_tokens"].values() == [len("Hello")]
        assert backend["lorafleet_request_latency_seconds"].records == []

    async def test_serve_signals_the_disconnect_by_raising_from_receive(self, tokenizer):
        from ray.exceptions import TaskCancelledError

        engine = FakeEngine(text_chunks("Hello"), hang=True)
        api = make_api(engine, tokenizer, _settings())
        body = json.dumps({"model": BASE, "prompt": "a", "stream": True}).encode()
        first_text_sent = asyncio.Event()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> dict:
            message = next(messages, None)
            if message is not None:
                return message
            await first_text_sent.wait()
            raise TaskCancelledError()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                first_text_sent.set()

        # A client gone is a normal end, not an error for Serve to log.
        await asyncio.wait_for(api(_asgi_scope("/v1/completions", "2.3"), receive, send), HANG_S)
        assert engine.aborted == [engine.requests[0].request_id]

    async def test_send_failing_mid_stream(self, tokenizer):
        engine = FakeEngine(text_chunks("ab"), endless=True)
        api = make_api(engine, tokenizer, _settings())
        body = json.dumps({"model": BASE, "prompt": "a", "stream": True}).encode()
        bodies_sent = 0

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            nonlocal bodies_sent
            if message["type"] == "http.response.body":
                bodies_sent += 1
                if bodies_sent == 3:
                    raise OSError("connection reset")

        with pytest.raises(Exception) as e:  # noqa: B017 - Starlette's ClientDisconnect
            await asyncio.wait_for(
                api(_asgi_scope("/v1/completions", "2.4"), receive, send), HANG_S
            )
        assert not isinstance(e.value, TimeoutError)  # the stream ended, not the wait
        assert engine.aborted == [engine.requests[0].request_id]

    async def test_finished_request_is_not_aborted(self, tokenizer):
        engine = FakeEngine(text_chunks("ab", "cd"))
        async with make_client(engine, tokenizer) as client:
            await client.post(
                "/v1/completions", json={"model": BASE, "prompt": "a", "stream": True}
            )
            await client.post("/v1/completions", json={"model": BASE, "prompt": "a"})
        assert len(engine.requests) == 2
        assert engine.aborted == []
