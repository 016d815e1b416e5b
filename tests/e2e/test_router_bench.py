"""The router benchmark end to end in its smoke mode (CPU, tiny model, two engine replicas) on
the shared e2e cluster: every router setup it runs serves the same workload through HTTP, and
the results file reports each of them with figures that make sense."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_router_serve import ROUTERS, SMOKE, parse_args, run

pytestmark = pytest.mark.serve

# Ray's default and our router with hints: every deploy costs about 16 s of a 2-core machine,
# and plain affinity differs from the second only in the hints flag, whose deployment
# tests/benchmarks/test_router_serve.py checks for every setup.
SMOKE_ROUTERS = ("pow2", "affinity+hints")


@pytest.fixture(scope="module")
def results(serve_cluster, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("router-serve")
    argv = ["--smoke", "--routers", ",".join(SMOKE_ROUTERS),
            "--out", str(tmp / "out"), "--work-dir", str(tmp / "work")]  # fmt: skip
    path = run(parse_args(argv), serve_cluster["url"], serve_cluster["metrics_url"])
    assert path == tmp / "out" / "router_serve_smoke.md" and path.is_file()
    return json.loads(path.with_suffix(".json").read_text())


class TestSmokeRun:
    """`bench_router_serve --smoke --routers pow2,affinity+hints`, once for the class."""

    def test_every_router_configuration_is_reported_once(self, results):
        routers = [row["router"] for row in results["rows"]]
        assert sorted(routers) == sorted(SMOKE_ROUTERS)
        assert set(SMOKE_ROUTERS) <= {setup.name for setup in ROUTERS}
        assert {row["popularity"] for row in results["rows"]} == {SMOKE["popularity"]}
        assert results["command"].startswith("python -m benchmarks.bench_router_serve --smoke")
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

    def test_each_row_carries_the_simulators_prediction_and_the_run_its_commit(self, results):
        assert results["commit"]
        for row in results["rows"]:
            assert row["sim_loads_per_1k"] >= 0.0 and row["sim_imbalance"] >= 1.0, row
            assert 0 < row["sim_ttft_p50_ms"] <= row["sim_ttft_p99_ms"], row

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
