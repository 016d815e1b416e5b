"""Predicted against measured: reading bench_router_serve's results, rebuilding the very
requests that run sent, and the 20% check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sim.validate import Cell, RunShape, compare, parse_measured, predict, table, within
from sim.workload import serving_benchmark

MEASURED = Path(__file__).parents[2] / "benchmarks/results/router_serve_2x_64a_r16_s8_skewed.json"


@pytest.fixture(scope="module")
def measured() -> dict:
    return json.loads(MEASURED.read_text())


class TestReadingARun:
    def test_shape_and_cells(self, measured):
        shape, cells = parse_measured(measured)
        assert (shape.replicas, shape.num_adapters, shape.slots, shape.host_cache) == (2, 64, 8, 64)
        assert (shape.rate, shape.num_requests) == (6.0, 300)
        assert shape.input_len == (128, 512) and shape.output_len == (32, 96)
        assert {(c.popularity, c.router) for c in cells} == {
            ("skewed", "affinity+hints"), ("skewed", "affinity"), ("skewed", "pow2"),
        }  # fmt: skip

    def test_the_workload_is_the_one_the_run_sent(self, measured):
        shape, _ = parse_measured(measured)
        w = serving_benchmark(
            num_adapters=shape.num_adapters, slots=shape.slots, replicas=shape.replicas,
            rate=shape.rate, num_requests=shape.num_requests, popularity="skewed",
            input_len=shape.input_len, output_len=shape.output_len, seed=shape.seed,
        )  # fmt: skip
        assert w.digest == measured["digests"]["skewed"]
        assert len(w.warmup) == 64 and {a.adapter for a in w.warmup} == {
            f"lora-{i}" for i in range(64)
        }
        assert len(w.measured) == 300 and w.measured[0].t == 0.0
        assert 300 / w.measured[-1].t == pytest.approx(6.0, rel=0.15)

    def test_other_files_are_refused(self):
        with pytest.raises(ValueError, match="not a bench_router_serve"):
            parse_measured({"rows": []})


class TestCheck:
    def test_within_tolerance(self):
        assert within(119.0, 100.0, 0.2) and within(81.0, 100.0, 0.2)
        assert not within(121.0, 100.0, 0.2) and not within(79.0, 100.0, 0.2)
        assert within(None, 100.0, 0.2) is None and within(math.nan, 1.0, 0.2) is None

    def test_rows_and_ratio_to_pow2(self):
        cells = [
            Cell("skewed", "affinity", {"loads_per_1k": 60, "imbalance": 1.1, "ttft_p99_ms": 100}),
            Cell("skewed", "pow2", {"loads_per_1k": 40, "imbalance": 1.0, "ttft_p99_ms": 200}),
        ]
        predicted = {
            ("skewed", "affinity"): {
                "loads_per_1k": 30.0, "imbalance": 1.2, "ttft_p99_ms": 110, "loads_vs_pow2": 0.75,
            },
            ("skewed", "pow2"): {
                "loads_per_1k": 40.0, "imbalance": 1.5, "ttft_p99_ms": 210, "loads_vs_pow2": 1.0,
            },
        }  # fmt: skip
        rows = compare(cells, predicted, 0.2)
        affinity = rows[0]
        assert affinity["loads_vs_pow2_measured"] == 1.5  # 60 / 40, from the measured rows
        assert affinity["loads_per_1k_ok"] is False and affinity["imbalance_ok"] is True
        assert affinity["loads_vs_pow2_ok"] is False
        assert rows[1]["imbalance_ok"] is False and rows[1]["ttft_p99_ms_ok"] is True
        text = table(rows, 0.2)
        assert "| skewed | affinity | 60 | 30 | NO |" in text
        assert text.endswith("5 of 8 predictions within 20%")


def test_predict_runs_every_router_on_the_cell():
    shape = RunShape(
        replicas=2, num_adapters=8, slots=2, host_cache=8, rate=20.0, num_requests=40,
        input_len=(32, 64), output_len=(4, 8), max_num_seqs=8, max_model_len=256, seed=0,
    )  # fmt: skip
    from sim.calibration import DEFAULT

    out = predict(shape, "skewed", ["affinity", "pow2"], DEFAULT, seeds=1)
    assert out["pow2"]["loads_vs_pow2"] == 1.0
    assert all(v["loads_per_1k"] > 0 and v["ttft_p99_ms"] > 0 for v in out.values())
