"""Hub adapters end to end: the app on the shared local Serve cluster (CPU, two engine replicas),
its hub a local server (tests/hub_server) reached through HF_ENDPOINT, which the app passes to
its replicas. A request naming an allowed hub adapter is answered token for token as
transformers + PEFT answer with the same weights, and both replicas serve the commit pinned at
first use, after the branch moved on."""

from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager

import httpx
import pytest

from tests.factories import hf_greedy, make_adapter, make_model
from tests.hub_server import FakeHub

pytestmark = pytest.mark.serve
APP = "lorafleet-e2e-hub"
PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9]]
MAX_TOKENS = 8


@contextmanager
def environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    from ray import serve

    from app.main import build_app

    root = tmp_path_factory.mktemp("e2e-hub")
    model = make_model(root / "model")
    v1 = make_adapter(model, root / "v1", rank=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj", "down_proj"], seed=31)  # fmt: skip
    v2 = make_adapter(model, root / "v2", rank=4, lora_alpha=8, seed=32)
    hub = FakeHub().start()
    first = hub.push_folder("myorg/sql-lora", v1)
    # The builder's HF_ENDPOINT and cache reach every replica (app.main.HUB_ENV).
    with environment(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(root / "hf-cache")):
        app = build_app(
            {
                "model": str(model),
                "served_model_name": "tiny",
                "hub_adapter_repos": ["myorg/*"],
                "device": "cpu",
                "num_replicas": 2,
                "max_loras_per_batch": 2,
                "max_lora_rank": 8,
                "max_model_len": 256,
            }
        )
    serve.run(app, name=APP, route_prefix="/")
    yield {"url": serve_cluster["url"], "model": model, "v1": v1, "v2": v2, "hub": hub,
           "first": first}  # fmt: skip
    serve.delete(APP)
    hub.stop()


async def completions(url: str, model: str, prompts) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                          "temperature": 0, "ignore_eos": True},
                )  # fmt: skip
                for p in prompts
            )
        )


def texts(responses) -> list[str]:
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in responses]


def served_by_each_replica() -> list[dict[str, str]]:
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    answers = handle.broadcast("served_adapters").results(timeout_s=30)
    return [answer["adapters"] for answer in answers]


def test_first_request_for_a_hub_adapter_matches_peft_and_both_replicas_pin_one_commit(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server["model"])
    expected = [
        tok.decode(hf_greedy(server["model"], p, MAX_TOKENS, adapter_dir=server["v1"]))
        for p in PROMPTS
    ]
    assert texts(asyncio.run(completions(server["url"], "myorg/sql-lora", PROMPTS))) == expected
    # The branch moves on; what the fleet serves under the name does not.
    server["hub"].push_folder("myorg/sql-lora", server["v2"])
    again = asyncio.run(completions(server["url"], "myorg/sql-lora", PROMPTS * 3))
    assert texts(again) == expected * 3
    pinned = f"hf://myorg/sql-lora@{server['first']}"
    assert [a.get("myorg/sql-lora") for a in served_by_each_replica()] == [pinned, pinned]
    listing = httpx.get(server["url"] + "/v1/adapters", timeout=30).json()
    card = next(c for c in listing["data"] if c["id"] == "myorg/sql-lora")
    assert (card["source"], card["path"]) == ("hub", pinned)
    assert {p["tier"] for p in card["replicas"]} <= {"gpu", "host", "loading", "hub", "disk"}


def test_hub_errors_through_http(server):
    async def main():
        async with httpx.AsyncClient(base_url=server["url"], timeout=60) as client:
            unknown = await client.post(
                "/v1/completions", json={"model": "myorg/nothing", "prompt": "a", "max_tokens": 1}
            )
            refused = await client.post(
                "/v1/completions", json={"model": "else/sql-lora", "prompt": "a", "max_tokens": 1}
            )
            return unknown, refused

    unknown, refused = asyncio.run(main())
    assert unknown.status_code == 404 and "myorg/nothing" in unknown.json()["error"]["message"]
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
