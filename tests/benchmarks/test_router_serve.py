"""The router benchmark's deployments: what it deploys for each router configuration, and the
tiny model it serves. Its smoke run through HTTP is an end-to-end test
(tests/e2e/test_router_bench.py)."""

from __future__ import annotations

import pytest

from benchmarks.bench_router_serve import (
    ROUTERS,
    app_args,
    build_application,
    parse_args,
)
from replicas.models.spec import ModelSpec
from synthetic.adapters import write_fleet
from synthetic.models import write_model
from synthetic.presets import TINY


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
                "AffinityRequestRouter" if setup.router == "affinity" else "Pow2Router"
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


class TestCells:
    def test_a_cell_sets_the_run_and_names_the_results(self):
        from dataclasses import replace

        from benchmarks.bench_router_serve import cell_of
        from sim.cells import CELLS

        for name, cell in CELLS.items():
            args = parse_args(["--cell", name, "--device", "cpu"])
            assert args.name == name
            run = cell_of(args, cell.popularity)
            assert replace(run, num_routers=None) == cell
            assert run.routers == 1  # one ingress on CPU; 2 per engine replica on GPUs

    def test_options_beside_a_cell_override_it(self):
        args = parse_args(["--cell", "placement-2x", "--rate", "3", "--device", "cpu"])
        assert args.rate == 3.0 and args.num_adapters == 256

    def test_unknown_cells_are_refused(self):
        with pytest.raises(SystemExit):
            parse_args(["--cell", "nope"])

    def test_every_router_stage_of_the_device_suite_names_a_cell(self):
        import re
        from pathlib import Path

        from sim.cells import CELLS

        script = (Path(__file__).parents[2] / "benchmarks/device_suite.sh").read_text()
        stages = set(re.findall(r"\brouter-(placement|easy|hot)(-4)?\b", script))
        assert {kind for kind, _ in stages} == {"placement", "easy", "hot"}
        for kind, four in stages:
            assert f"{kind}-{'4x' if four else '2x'}" in CELLS

    def test_the_hot_adapters_gpu_copies_are_counted(self):
        from benchmarks.bench_router_serve import placement

        listing = {
            "data": [
                {"id": "lora-0", "replicas": [{"tier": "gpu"}, {"tier": "loading"}]},
                {"id": "lora-1", "replicas": [{"tier": "host"}, {"tier": "absent"}]},
            ]
        }
        got = placement(listing)
        assert got["hot_gpu"] == 2
        assert got["gpu_copies"] == 2 and got["memory_copies"] == 1.5
        assert placement(None)["hot_gpu"] is None
