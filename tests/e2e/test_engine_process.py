"""The app on Ray Serve with `engine_process: true`: the engine replica's engine runs in a
process of its own, and through HTTP nothing else changes (PEFT's tokens, streaming, an adapter
loaded at run time, a client's hang-up aborting its request)."""

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.factories import hf_greedy, make_adapter, make_model

pytestmark = pytest.mark.serve
APP = "lorafleet-engine-process"
PROMPT = [5, 17, 200, 33, 98, 4]
MAX_MODEL_LEN = 2048  # a request left alone runs for many seconds on CPU


@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    from ray import serve

    from app.main import build_app

    root = tmp_path_factory.mktemp("engine-process")
    model = make_model(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    alpha = make_adapter(model, root / "alpha", rank=4, lora_alpha=8, target_modules=["q_proj"])
    delta = make_adapter(
        model, root / "delta", rank=8, lora_alpha=8, target_modules=["v_proj"], seed=4
    )
    app = build_app(
        {
            "model": str(model),
            "served_model_name": "tiny",
            "adapters": {"alpha": str(alpha)},
            "runtime_adapter_dirs": [str(root)],
            "device": "cpu",
            "num_replicas": 1,
            "max_model_len": MAX_MODEL_LEN,
            "engine_process": True,
        }
    )
    serve.run(app, name=APP, route_prefix="/")
    yield {"url": serve_cluster["url"], "model": model, "alpha": alpha, "delta": delta}
    serve.delete(APP)


def _complete(server, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(server["url"] + "/v1/completions", json={**body, "ignore_eos": True},
                      timeout=120)  # fmt: skip


def _engine_processes() -> list[int]:
    """Spawned children of this app's engine replica (Ray titles it after the app)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_cmdline = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmdline and APP.encode() in parent_cmdline:
            found.append(int(entry.name))
    return found


def test_tokens_and_adapters_through_the_engine_process(server):
    from transformers import AutoTokenizer

    assert len(_engine_processes()) == 1

    tok = AutoTokenizer.from_pretrained(server["model"])
    for model, adapter in (("tiny", None), ("alpha", server["alpha"])):
        r = _complete(server, model)
        assert r.status_code == 200, r.text
        expected = hf_greedy(server["model"], PROMPT, 6, adapter_dir=adapter)
        assert r.json()["choices"][0]["text"] == tok.decode(expected), model
    loaded = httpx.post(
        server["url"] + "/v1/load_lora_adapter",
        json={"lora_name": "delta", "lora_path": str(server["delta"])},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    r = _complete(server, "delta")
    assert r.status_code == 200, r.text
    expected = hf_greedy(server["model"], PROMPT, 6, adapter_dir=server["delta"])
    assert r.json()["choices"][0]["text"] == tok.decode(expected)
    listed = httpx.get(server["url"] + "/v1/adapters", timeout=30).json()
    assert "delta" in json.dumps(listed)


def test_a_hang_up_aborts_the_request_in_the_engine_process(server):
    from ray import serve

    engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    aborted = engine.stats.remote().result(timeout_s=30)["num_aborted"]
    body = {"model": "tiny", "prompt": "x", "max_tokens": MAX_MODEL_LEN - 16, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the abort reaches the child between two steps
        stats = engine.stats.remote().result(timeout_s=30)
        if stats["num_aborted"] > aborted and stats["num_running"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_aborted"] == aborted + 1 and stats["num_running"] == 0, stats
