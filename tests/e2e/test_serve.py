"""The whole app on a local Ray Serve instance (CPU, two engine replicas), through HTTP, and
what happens when clients hang up and replicas die."""

import asyncio
import json
import time

import httpx
import pytest

from tests.factories import hf_greedy, make_adapter, make_model

pytestmark = pytest.mark.serve
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9]]
APP = "lorafleet-e2e"
# Long enough that a request left alone runs for minutes on CPU (thousands of decode steps).
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    from ray import serve

    from app.main import build_app

    root = tmp_path_factory.mktemp("e2e")
    model = make_model(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    adapters = {
        "alpha": make_adapter(
            model, root / "alpha", rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1
        ),
        "beta": make_adapter(
            model, root / "beta", rank=8, lora_alpha=16, target_modules=ALL, use_rslora=True, seed=2
        ),
        "gamma": make_adapter(
            model,
            root / "adapter_root" / "gamma",
            rank=2,
            lora_alpha=8,
            target_modules=["o_proj", "down_proj"],
            seed=3,
        ),
        # Loaded at run time, through the API.
        "delta": make_adapter(
            model,
            root / "delta",
            rank=8,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"],
            seed=4,
        ),
    }
    bad = root / "adapter_root" / "broken"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{oops")
    app = build_app(
        {
            "model": str(model),
            "served_model_name": "tiny",
            "adapters": {"alpha": str(adapters["alpha"]), "beta": str(adapters["beta"])},
            "adapter_root": str(root / "adapter_root"),
            "runtime_adapter_dirs": [str(root)],
            "device": "cpu",
            "num_replicas": 2,
            "max_loras_per_batch": 4,
            "max_lora_rank": 8,
            "max_model_len": MAX_MODEL_LEN,
        }
    )
    serve.run(app, name=APP, route_prefix="/")
    yield {"url": serve_cluster["url"], "model": model, "adapters": adapters}
    serve.delete(APP)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_concurrent_base_and_adapters_match_peft(server):
    tok = _tokenizer(server["model"])
    cases = [(m, p) for m in ("tiny", "alpha", "beta", "gamma", "tiny:beta") for p in PROMPTS]

    async def one(client, model, prompt):
        r = await client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def main():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as client:
            return await asyncio.gather(*(one(client, m, p) for m, p in cases))

    results = asyncio.run(main())
    for (model, prompt), body in zip(cases, results, strict=True):
        name = model.split(":")[-1]
        adapter = server["adapters"].get(name)
        expected = hf_greedy(server["model"], prompt, 8, adapter_dir=adapter)
        assert body["choices"][0]["text"] == tok.decode(expected), model
        assert body["usage"]["completion_tokens"] == 8


def test_models_lists_base_and_adapters(server):
    r = httpx.get(server["url"] + "/v1/models", timeout=30)
    ids = {m["id"] for m in r.json()["data"]}
    assert {"tiny", "alpha", "beta"} <= ids


def test_streamed_chat_to_an_adapter(server):
    body = {
        "model": "beta",
        "stream": True,
        "max_tokens": 6,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    events = []
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" or any(
        c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks
    )


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        ({"model": "nope", "prompt": "hi"}, 404, "nope"),
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": [1] * (MAX_MODEL_LEN + 1)}, 400, str(MAX_MODEL_LEN)),
        ({"model": "broken", "prompt": "hi"}, 400, "JSON"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    server, payload, status, needle
):
    r = httpx.post(server["url"] + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(
        server["url"] + "/v1/completions",
        json={"model": "alpha", "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_malformed_json_is_400(server):
    r = httpx.post(
        server["url"] + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert "error" in r.json()


def _fleet_stats() -> list[dict]:
    return _engine_handle().broadcast("stats").results(timeout_s=30)


def _idle(stats: dict) -> bool:
    return (
        stats["num_running"] == stats["num_waiting"] == stats["num_held_slots"] == 0
        and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    )


def _wait(condition, timeout_s: float, period_s: float = 0.05) -> tuple[list[dict], float]:
    """Poll every engine replica's stats until `condition(stats)`; returns the last stats and
    the seconds it took (past `timeout_s`, whatever they were then)."""
    start = time.monotonic()
    while True:
        every = _fleet_stats()
        waited = time.monotonic() - start
        if condition(every) or waited > timeout_s:
            return every, waited
        time.sleep(period_s)


def _total(every: list[dict], key: str) -> int:
    return sum(stats[key] for stats in every)


def test_client_disconnect_aborts_the_request(server):
    aborted = _total(_fleet_stats(), "num_aborted")
    # Left alone, this request would run for minutes: only an abort ends it in time (and
    # only an abort counts in `num_aborted`).
    body = {
        "model": "alpha",
        "prompt": "x",
        "max_tokens": MAX_MODEL_LEN - 16,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    every, waited = _wait(lambda every: all(_idle(s) for s in every), timeout_s=60.0)
    assert len(every) == 2 and all(_idle(s) for s in every), every
    # Left alone it would run for minutes; the abort is counted below. The bound is far above
    # the fraction of a second an abort takes, so a loaded machine's slow stats reads pass.
    assert waited < 30.0, f"the engine stopped {waited:.1f} s after the client hung up"
    assert _total(every, "num_aborted") == aborted + 1


def _post(server, route, payload):
    return httpx.post(server["url"] + route, json=payload, timeout=120)


def _engine_handle():
    from ray import serve

    return serve.get_deployment_handle("EngineDeployment", app_name="lorafleet-e2e")


def test_adapter_loaded_at_run_time_matches_peft_on_every_replica(server):
    tok = _tokenizer(server["model"])
    path = server["adapters"]["delta"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'delta' added successfully."
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(path)})
    assert again.status_code == 400

    # Both replicas serve it (the load was broadcast); enough requests to reach each of them.
    served = _engine_handle().broadcast("served_adapters").results(timeout_s=30)
    assert [s["adapters"].get("delta") for s in served] == [str(path)] * 2

    async def main():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json={
                            "model": "delta",
                            "prompt": prompt,
                            "max_tokens": 8,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    for prompt in PROMPTS * 3
                )
            )

    responses = asyncio.run(main())
    for prompt, response in zip(PROMPTS * 3, responses, strict=True):
        assert response.status_code == 200, response.text
        expected = hf_greedy(server["model"], prompt, 8, adapter_dir=path)
        assert response.json()["choices"][0]["text"] == tok.decode(expected)
    models = httpx.get(server["url"] + "/v1/models", timeout=30).json()["data"]
    assert {"id": "delta", "root": str(path), "parent": "tiny"}.items() <= {
        k: v for m in models if m["id"] == "delta" for k, v in m.items()
    }.items()


def test_unload_during_a_long_stream(server):
    path = server["adapters"]["delta"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "long", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    body = {
        "model": "long",
        "prompt": [5, 17],
        # Hundreds of steps while the unload and a stats read take a few: the request is still
        # running when they land, however slow the machine (they slow down alike).
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=120) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                break
        unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "long"})
        stats = _engine_handle().broadcast("stats").results(timeout_s=30)
        refused = _post(server, "/v1/completions", {"model": "long", "prompt": "hi"})
        events += [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'long' removed successfully."
    assert sum(s["num_running"] for s in stats) == 1  # the unload came while it ran
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["code"] == "model_not_found"
    # The stream ran to its end regardless.
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 400
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    models = {m["id"] for m in httpx.get(server["url"] + "/v1/models", timeout=30).json()["data"]}
    assert "long" not in models


def test_unloading_an_unknown_adapter_is_404(server):
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404, r.text
    assert "never-loaded" in r.json()["error"]["message"]


def test_adapters_listing_shows_tiers_on_each_replica(server):
    ok = _post(server, "/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    r = httpx.get(server["url"] + "/v1/adapters", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    replica_ids = [s["replica_id"] for s in body["replicas"]]
    assert len(set(replica_ids)) == 2 and all(s["available"] for s in body["replicas"])
    cards = {c["id"]: c for c in body["data"]}
    assert {"alpha", "beta"} <= set(cards)
    alpha = cards["alpha"]
    assert (alpha["source"], alpha["rank"]) == ("config", 4)
    assert sorted(p["replica_id"] for p in alpha["replicas"]) == sorted(replica_ids)
    tiers = {p["tier"] for c in cards.values() for p in c["replicas"]}
    assert tiers <= {"gpu", "loading", "host", "disk"}
    # alpha just ran on one of them: its weights are there (in a slot, or on their way).
    assert {p["tier"] for p in alpha["replicas"]} & {"gpu", "loading", "host"}
    assert alpha["size_bytes"] > 0


def test_a_name_can_be_loaded_again_after_unloading(server):
    payload = {"lora_name": "again", "lora_path": str(server["adapters"]["delta"])}
    assert _post(server, "/v1/load_lora_adapter", payload).status_code == 200
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    r = _post(server, "/v1/load_lora_adapter", payload)
    assert r.status_code == 200, r.text


def test_chaos_every_request_ends_and_the_fleet_comes_back_whole(server):
    """Streaming traffic with hang-ups, adapter churn, and a kill -9 of an engine replica and
    of the ingress (benchmarks/bench_chaos.py, a short run). Runs last: it restarts replicas."""
    from benchmarks.bench_chaos import ChaosPlan, run_chaos

    delta = str(server["adapters"]["delta"])
    # A runtime load the restarted engine replica must serve, and an unload it must remember.
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "keeper", "lora_path": delta})
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    plan = ChaosPlan(
        models=("tiny", "alpha", "keeper"),
        churn_path=delta,
        duration_s=12.0,
        clients=4,
        kill_engine_at=0.15,
        kill_ingress_at=0.5,
    )
    report = asyncio.run(run_chaos(server["url"], APP, plan, num_engines=2))
    print(json.dumps(report, indent=1))
    assert report["hung"] == 0, report
    assert report["settled"], report  # whole, idle, every KV block free, no slot held
    assert report["problems"] == [], report
    assert set(report["recovery"]) == {"EngineDeployment", "Ingress"}
    # The dead ingress's requests ended in the engines: its gRPC streams closed with its process
    # (the engines abort a cancelled call's request), or else its lease lapsed (0.5 s after its
    # last request or answer from the GCS; the engines look every 0.25 s) and the GCS said it
    # was dead; `orphan_abort_s` is when the last of them ended. The lease took 0.5-0.7 s
    # typically, once in 25 runs 2.1 s on a loaded 2-core machine (the GCS slow to report the
    # killed actor dead). The orphans' own 2,000 tokens would take far longer.
    assert report["orphans"] == plan.orphans, report
    assert report["orphan_abort_s"] is not None and report["orphan_abort_s"] < 2.5, report
    # Streams cut without [DONE] are only those the ingress was sending when it died.
    killed = report["ingress_killed_s"]
    assert all(u["started_s"] < killed <= u["ended_s"] + 0.5 for u in report["unclean"]), report
    # Once settled, the fleet serves every model again. Recovery from the ingress kill can
    # outlast the 12 s of traffic on a loaded machine (the engine's took 18 s once), so the
    # first success after a kill may be one of these.
    assert report["after_settle"] == {"ok": len(plan.models)}, report
    assert all(r["first_ok_after_s"] is not None for r in report["recovery"].values()), report
    # The replica Serve started after the kill serves what the fleet was told at run time.
    served = _engine_handle().broadcast("served_adapters").results(timeout_s=30)
    assert len(served) == 2
    assert all(s["adapters"].get("keeper") == delta for s in served), served
    assert all("gamma" in s["unloaded"] and "gamma" not in s["adapters"] for s in served)
