"""The GPU routing cells: each is a bench_router_serve run, and the simulator predicts it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.bench_router_serve import parse_args, workloads
from sim.cells import CELLS, HOT, RouterCell, calibration, http_overhead_s, predict
from sim.fleet import ROUTERS
from workloads.requests import workload_digest


class TestCells:
    def test_each_kind_on_two_and_four_replicas(self):
        for kind in ("placement", "easy", "hot"):
            assert {CELLS[f"{kind}-{n}x"].replicas for n in (2, 4)} == {2, 4}

    def test_placement_cells_are_placement_bound(self):
        # A catalogue several times the fleet's slots and 4x its host memory, adapters whose
        # copy costs about a decode step.
        cal = calibration()
        for n in (2, 4):
            cell = CELLS[f"placement-{n}x"]
            assert cell.num_adapters >= 4 * cell.slots * cell.replicas
            assert cell.num_adapters >= 4 * cell.host_cache
            cost = cal.for_rank(cell.rank)
            assert cost.copy_s >= cost.step_s(32, cell.slots, 0) * 0.5
            assert 0 < cell.capacity_share(cal) < 1

    @pytest.mark.parametrize("name", ["easy-2x", "placement-4x"])
    def test_the_simulated_requests_are_the_ones_the_benchmark_sends(self, name):
        cell = CELLS[name]
        args = parse_args(["--cell", name])
        assert (args.replicas, args.num_adapters, args.rank, args.slots) == (
            cell.replicas, cell.num_adapters, cell.rank, cell.slots,
        )  # fmt: skip
        sent = workloads(args, [f"lora-{i}" for i in range(args.num_adapters)], cell.popularity)
        assert workload_digest(sent.measured) == cell.workload().digest


def test_prediction_of_a_small_hot_cell():
    cell = RouterCell(
        "tiny-hot", replicas=2, num_adapters=8, rank=16, slots=2, host_cache=8, rate=20.0,
        num_requests=300, popularity="hot", input_len=(16, 64), output_len=(4, 8),
    )  # fmt: skip
    out = predict(cell, calibration(), seeds=1)
    assert set(out) == set(ROUTERS)
    for figures in out.values():
        assert 0 <= figures["arrival_hit_rate"] <= 1
        assert figures["imbalance"] >= 1
        assert figures["throughput_tok_s"] > 0
    # Half the traffic is one adapter: the affinity router spreads it over both replicas.
    assert out["affinity"]["hot_replicas"] == 2
    assert math.isfinite(out["affinity"]["hot_spread_s"])
    assert HOT == "lora-0"


class TestHttpOverhead:
    def test_measured_as_http_less_in_process_less_the_modelled_hops(self, tmp_path):
        run = tmp_path / "seeds.json"
        rows = [
            {"path": "http", "ttft_p50_ms": 50.0},
            {"path": "in-process", "ttft_p50_ms": 30.0},
            {"path": "roofline", "ttft_p50_ms": None},
        ]
        run.write_text(json.dumps({"rows": rows}))
        assert http_overhead_s(run, rpc_s=0.001) == pytest.approx(0.018)

    def test_the_recorded_seeds_run(self):
        # bench_serve_seeds_warmup: 48.3 ms through HTTP, 28.5 in-process, 2 x 0.5 ms modelled.
        assert http_overhead_s() == pytest.approx(0.0188, abs=1e-4)

    def test_a_run_without_both_paths_is_refused(self, tmp_path):
        run = tmp_path / "seeds.json"
        run.write_text(json.dumps({"rows": [{"path": "http", "ttft_p50_ms": 50.0}]}))
        with pytest.raises(ValueError, match="in-process"):
            http_overhead_s(run)
