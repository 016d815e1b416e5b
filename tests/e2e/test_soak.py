"""The soak (slow tier: `python -m pytest --slow -m slow`): minutes of streamed and whole
requests through four ingress replicas and two engine replicas, clients hanging up at random,
adapter loads and unloads in between, nothing killed. No request may be lost by the fleet, and
afterwards every KV block and slot is free."""

import asyncio
import json

import pytest

from tests.factories import make_adapter, make_model

pytestmark = [pytest.mark.serve, pytest.mark.slow]
APP = "lorafleet-soak"
SOAK_S = 180.0


@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    from ray import serve

    from app.main import build_app

    root = tmp_path_factory.mktemp("soak")
    model = make_model(root / "model", max_position_embeddings=4096)
    adapters = {
        name: make_adapter(model, root / name, rank=4, target_modules=["q_proj", "v_proj"], seed=i)
        for i, name in enumerate(("alpha", "beta", "churn"), start=1)
    }
    app = build_app(
        {
            "model": str(model),
            "served_model_name": "tiny",
            "adapters": {"alpha": str(adapters["alpha"]), "beta": str(adapters["beta"])},
            "runtime_adapter_dirs": [str(root)],
            "device": "cpu",
            "num_replicas": 2,
            "num_ingress_replicas": 4,
            "max_loras_per_batch": 2,
            "max_lora_rank": 8,
            "max_model_len": 4096,
        }
    )
    serve.run(app, name=APP, route_prefix="/")
    yield {"url": serve_cluster["url"], "adapters": adapters}
    serve.delete(APP)


def test_no_request_is_lost_under_minutes_of_mixed_load(server):
    from benchmarks.bench_chaos import SOAK, ChaosPlan, run_chaos

    plan = ChaosPlan(
        models=("tiny", "alpha", "beta"),
        churn_path=str(server["adapters"]["churn"]),
        duration_s=SOAK_S,
        clients=8,
        **SOAK,
    )
    report = asyncio.run(run_chaos(server["url"], APP, plan, num_engines=2))
    print(json.dumps(report, indent=1))
    assert report["lost"] == 0 and report["hung"] == 0, report["outcomes"]
    assert report["abandoned"] == 0, report  # every caller lived: none of its requests went
    assert report["server_errors"] == [], report["server_errors"]
    assert report["settled"], report  # idle, every KV block free, no slot held
    assert report["problems"] == [], report["problems"]
    kinds = report["outcomes"]
    assert kinds.get("ok", 0) > 100 and kinds.get("hung_up", 0) > 20, kinds
