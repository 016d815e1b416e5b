"""The router benchmark's deployments: what it deploys for each router configuration, and the
tiny model it serves. Its smoke run through HTTP is an end-to-end test
(tests/e2e/test_router_bench.py)."""

from __future__ import annotations

import pytest

from benchmarks.bench_churn import TINY, write_fleet
from benchmarks.bench_router_serve import (
    ROUTERS,
    app_args,
    build_application,
    parse_args,
    write_model,
)
from replicas.models.spec import ModelSpec


class TestDeployment:
    def test_each_configuration_deploys_its_router_with_or_without_hints(self, tmp_path):
        pytest.importorskip("ray")
        model_dir = write_model(tmp_path, TINY)
        fleet = write_fleet(tmp_path, ModelSpec.from_dir(model_dir), ["a", "b"], rank=4)
        args = parse_args(["--smoke"])
        for setup in ROUTERS:
            app = build_application(app_args(args, setup, model_dir, fleet), setup)
            # The ingress is bound with the engine deployment as its first argument.
            engine = app._bound_deployment.init_args[0]._bound_deployment
            config = engine._deployment_config.request_router_config
            assert config.request_router_class.endswith(
                "AffinityRequestRouter"
                if setup.router == "affinity"
                else "Pow2Router"
            )
            hints = config.request_router_kwargs.get("prefetch_hints", False)
            assert hints == setup.prefetch_hints, setup

    def test_every_token_id_of_the_model_decodes_to_text(self, tmp_path):
        from transformers import AutoTokenizer

        model_dir = write_model(tmp_path, TINY)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert len(tokenizer) == TINY["vocab_size"]
        assert tokenizer.decode([65, 66]) == "AB"  # bytes stay bytes
        assert tokenizer.decode([300, TINY["vocab_size"] - 1]).split() == ["x300", "x511"]
