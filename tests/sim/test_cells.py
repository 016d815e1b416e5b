"""The GPU routing cells: each is a bench_router_serve run, and the simulator predicts it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.bench_router_serve import parse_args, workloads
from sim.cells import (
    CELLS,
    HOT,
    SERVED_PATH_RUN,
    RouterCell,
    ServedPath,
    calibration,
    predict,
    served_path,
)
from sim.fleet import ROUTERS
from sim.workload import one_adapter_serving
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


class TestServedPath:
    """What HTTP and Serve add, from a one-adapter bench_serve run through HTTP and in-process."""

    @staticmethod
    def run_file(tmp_path, http_ttft=50.0, http_itl=8.0):
        run = tmp_path / "seeds.json"
        workload = {"requests": 40, "prompts": "200:400", "outputs": "20:40", "rate": 8.0,
                    "max_num_seqs": 16}  # fmt: skip
        rows = [
            {"path": "http", "ttft_p50_ms": http_ttft, "itl_p50_ms": http_itl},
            {"path": "in-process", "ttft_p50_ms": 30.0, "itl_p50_ms": 6.0},
            {"path": "roofline", "ttft_p50_ms": None},
        ]
        run.write_text(json.dumps({"workload": workload, "rows": rows}))
        return run

    def test_steps_as_much_slower_as_the_itl_says(self, tmp_path):
        served = served_path(self.run_file(tmp_path), rpc_s=0.001)
        assert served.step_s == pytest.approx(0.002)
        # The rest of the 20 ms is HTTP's: less the two hops and the slower steps' share of a
        # first token (at least the prefill step's, at most a few steps').
        assert 0.018 - 4 * 0.002 < served.overhead_s < 0.018 - 0.002

    def test_without_slower_steps_all_of_the_difference_is_http(self, tmp_path):
        served = served_path(self.run_file(tmp_path, http_itl=6.0), rpc_s=0.001)
        assert served.step_s == 0 and served.overhead_s == pytest.approx(0.018)

    def test_the_recorded_seeds_run(self):
        # bench_serve_seeds_warmup: ITL P50 9.67 through HTTP against 7.45 in-process; TTFT
        # P50 48.3 against 28.5, less 2 x 0.5 ms of hops and 4.0 ms the slower steps add.
        served = served_path()
        assert served.step_s == pytest.approx(0.00222, abs=1e-5)
        assert served.overhead_s == pytest.approx(0.0148, abs=2e-4)

    def test_it_replays_the_requests_the_run_sent(self):
        run = json.loads(SERVED_PATH_RUN.read_text())
        w = one_adapter_serving(num_requests=480, input_len=(200, 1000), output_len=(100, 400),
                                rate=8.0, max_num_seqs=128)  # fmt: skip
        assert w.digest == run["digests"]["1 adapter"]
        assert len(w.warmup) == 128 and all(a.output == 8 for a in w.warmup)

    def test_a_run_without_both_paths_is_refused(self, tmp_path):
        run = tmp_path / "seeds.json"
        run.write_text(json.dumps({"rows": [{"path": "http", "ttft_p50_ms": 50.0}]}))
        with pytest.raises(ValueError, match="in-process"):
            served_path(run)

    def test_the_slower_steps_show_in_the_predicted_itl(self):
        cell = CELLS["easy-2x"]
        plain = predict(cell, calibration(), ("pow2",), seeds=1)["pow2"]
        served = predict(cell, calibration(), ("pow2",), seeds=1, served=ServedPath(0.0, 0.002))
        assert served["pow2"]["itl_p50_ms"] == pytest.approx(plain["itl_p50_ms"] + 2.0, abs=0.1)


class TestWarmupBurst:
    """The benchmark's warm-up is sent "all at once" by one client, so its requests arrive one
    after another in the order sent (`python -m sim.burst`), not at one instant; the engines
    then take them in that order."""

    def test_the_warm_up_arrives_in_the_order_sent(self):
        from sim.workload import BURST_GAP_S

        warm = CELLS["easy-4x"].workload().warmup
        times = [a.t for a in warm]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert times[-1] == pytest.approx((len(warm) - 1) * BURST_GAP_S)
        assert [a.adapter for a in warm] == [f"lora-{i}" for i in range(64)]

    @pytest.mark.parametrize(
        ("name", "router"), [("easy-2x", "pow2"), ("easy-2x", "affinity"), ("easy-4x", "pow2")]
    )
    def test_the_first_adapters_sent_hold_no_slot_when_the_run_starts(self, name, router):
        # Each engine admits its share of the burst about in the order sent, and its slots
        # keep the last ones admitted: the adapters sent first, the most popular, start cold
        # (so the run's first requests for them load them: the measured loads).
        from sim.fleet import Fleet, FleetConfig

        cell = CELLS[name]
        config = FleetConfig(
            num_replicas=cell.replicas, router=router, num_routers=cell.routers,
            replica=cell.replica_config(),
        )  # fmt: skip
        fleet = Fleet(config, cell.workload(), calibration().for_rank(cell.rank))
        on_gpu: list[str] = []
        start = fleet._start_measured

        def snapshot() -> None:
            for replica in fleet.replicas.values():
                on_gpu.extend(replica.engine.adapters.residency()["gpu"])
            start()

        fleet._start_measured = snapshot  # type: ignore[method-assign]
        fleet.run(max_t=10.0)
        assert len(on_gpu) == cell.replicas * cell.slots  # every slot filled by the warm-up
        assert not set(on_gpu) & {f"lora-{i}" for i in range(8)}
