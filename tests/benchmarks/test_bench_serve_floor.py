"""The floor benchmark's figures and the arguments it refuses (no cluster)."""

from __future__ import annotations

import pytest

from benchmarks.bench_serve_floor import TARGET_US_PER_TOKEN, figures, main


def test_a_rows_figures_subtract_each_roles_idle_rate():
    busy = {"proxy": 1.0, "ingress": 3.0, "engine": 0.05}
    idle = {"proxy": 0.2, "ingress": 0.4, "engine": 0.2}  # over 2 s: 0.1, 0.2, 0.1 of a core
    row = figures(busy, idle, 2.0, 4.0, 1000, 100)
    assert row["proxy_ms_per_request"] == pytest.approx(0.6)  # (1.0 - 0.4) s / 1000
    assert row["ingress_ms_per_request"] == pytest.approx(2.2)
    assert row["engine_ms_per_request"] == 0  # below its idle rate: none of it is the burst's
    assert row["ingress_idle_cores"] == pytest.approx(0.2)
    assert row["ms_per_request"] == pytest.approx(2.8)
    assert row["us_per_token"] == pytest.approx(28.0)  # 2.8 ms / 100 tokens
    assert row["of_target"] == pytest.approx(28.0 / TARGET_US_PER_TOKEN)


@pytest.mark.parametrize(
    "argv",
    [["--requests", "0"], ["--concurrency", "0"], ["--hold-s", "-1"], ["--idle-s", "0"],
     ["--output-tokens", "0"], ["--flush-s", "-0.1"]],  # fmt: skip
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
