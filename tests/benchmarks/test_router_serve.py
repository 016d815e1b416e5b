"""The router benchmark on a real Serve deployment: what it deploys for each router
configuration, and the whole benchmark end to end in its smoke mode (CPU, tiny model, two
engine replicas), where every configuration runs the same workload through HTTP and the results
file reports each of them with figures that make sense."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_churn import TINY, write_fleet
from benchmarks.bench_router_serve import (
    ROUTERS,
    SMOKE,
    app_args,
    build_application,
    parse_args,
    write_model,
)
from replicas.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The smoke run deploys Ray's default and our router with hints: every deploy costs about 16 s
# of this machine's cores, and plain affinity differs from the second only in the hints flag,
# whose deployment `TestDeployment` checks for every setup.
SMOKE_ROUTERS = ("pow2", "affinity+hints")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    pytest.importorskip("ray")
    tmp = tmp_path_factory.mktemp("router-serve")
    command = [
        sys.executable, "-m", "benchmarks.bench_router_serve", "--smoke",
        "--routers", ",".join(SMOKE_ROUTERS),
        "--port", str(_free_port()), "--out", str(tmp / "out"), "--work-dir", str(tmp / "work"),
    ]  # fmt: skip
    # Its own process: the benchmark starts (and stops) a Ray cluster of its own.
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp / "out" / "router_serve_smoke.md").is_file()
    return json.loads((tmp / "out" / "router_serve_smoke.json").read_text())


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
                else "PowerOfTwoChoicesRequestRouter"
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


@pytest.mark.serve
class TestSmokeRun:
    """`python -m benchmarks.bench_router_serve --smoke --routers pow2,affinity+hints`, once for
    the class (about a minute)."""

    def test_every_router_configuration_is_reported_once(self, results):
        routers = [row["router"] for row in results["rows"]]
        assert sorted(routers) == sorted(SMOKE_ROUTERS)
        assert set(SMOKE_ROUTERS) <= {setup.name for setup in ROUTERS}
        assert {row["popularity"] for row in results["rows"]} == {SMOKE["popularity"]}
        assert "bench_router_serve" in results["command"] and "--smoke" in results["command"]
        assert results["engine_device"] == "cpu" and results["replicas"] == SMOKE["replicas"]

    def test_every_request_completes_and_is_counted_once_by_the_engines(self, results):
        for row in results["rows"]:
            assert row["sent"] == SMOKE["num_requests"], row
            assert row["completed"] == row["sent"] and row["failed"] == 0, row
            assert row["admissions"] == row["sent"], row  # warm-up excluded, nothing twice
            assert len(row["requests_per_replica"]) == SMOKE["replicas"], row
            assert sum(row["requests_per_replica"]) == row["sent"], row

    def test_figures_are_in_range(self, results):
        for row in results["rows"]:
            assert 0.0 <= row["hit_rate"] <= 1.0, row
            assert row["imbalance"] >= 1.0, row
            assert row["imbalance"] <= SMOKE["replicas"], row
            assert row["loads_per_1k"] >= 0.0 and row["adapter_wait_mean_ms"] >= 0.0, row
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"], row
            assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"], row
            assert row["e2e_p50_s"] > 0 and row["throughput_tok_s"] > 0, row
            assert 1.0 <= row["memory_copies"] <= SMOKE["replicas"], row

    def test_ratios_are_against_pow2_in_the_same_run(self, results):
        rows = {row["router"]: row for row in results["rows"]}
        pow2 = rows["pow2"]
        assert pow2["ttft_p50_vs_pow2"] == pytest.approx(1.0)
        for row in rows.values():
            assert row["ttft_p50_vs_pow2"] == pytest.approx(
                row["ttft_p50_ms"] / pow2["ttft_p50_ms"]
            )
            assert row["throughput_vs_pow2"] == pytest.approx(
                row["throughput_tok_s"] / pow2["throughput_tok_s"]
            )
