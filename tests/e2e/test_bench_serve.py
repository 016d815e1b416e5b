"""The serving benchmark on timed steps (`bench_serve --timed --smoke`) through the shared e2e
cluster: the real app through HTTP and the engine in-process on the same requests, with the
serving processes' CPU per token read from the OS. No timing is asserted: the figures' shape is."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pytest

from benchmarks.bench_serve import CALIBRATION, HOST_SHARE, main

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def results(serve_cluster, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench-serve")
    port = urlparse(serve_cluster["url"]).port
    argv = ["--workload", "seeds", "--smoke", "--timed", "--port", str(port),
            "--out", str(tmp / "out"), "--work-dir", str(tmp / "work")]  # fmt: skip
    path = main(argv)
    assert path == tmp / "out" / "bench_serve_seeds_timed_smoke.md"
    return json.loads(path.with_suffix(".json").read_text())


def test_both_paths_complete_every_request_on_timed_steps(results):
    rows = {row["path"]: row for row in results["rows"]}
    assert rows["http"]["completed"] == rows["in-process"]["completed"] == 12
    assert rows["http"]["failed"] == rows["in-process"]["failed"] == 0
    # the engine reads the calibration with the host's share of a step added
    timed = json.loads(Path(results["app_args"]["timed_steps"]).read_text())
    measured = json.loads(CALIBRATION.read_text())["step"]
    assert timed["step"] == {**measured, "host_share": HOST_SHARE}
    assert results["host_share"] == HOST_SHARE
    assert results["app_args"]["device"] == "cpu"
    assert results["calibration"]["device"]  # the GPU whose steps are modelled
    # the HTTP run sampled its one engine replica's queue from the stream's start (how many
    # rounds catch a request running depends on the timing: not asserted)
    http = rows["http"]
    samples = http["replica_samples"]
    times = [t for t, _, _, _ in samples]
    assert samples and times == sorted(times) and times[0] >= 0
    assert len({rid for _, rid, _, _ in samples}) == 1
    assert all(running >= 0 and waiting >= 0 for _, _, running, waiting in samples)
    assert len(http["replica_busy_until_s"]) == 1
    assert 0 <= http["replica_busy_until_s"][0] <= samples[-1][0] + 0.005  # 2 decimals
    # each path's slowest first tokens and engine steps, to place a stall in the run
    (replica,) = {rid for _, rid, _, _ in samples}
    for path in ("http", "in-process"):
        r = rows[path]
        ttft = [t["ttft_ms"] for t in r["slowest_ttft"]]
        assert len(ttft) == 8 and ttft == sorted(ttft, reverse=True), path
        steps = r["slowest_steps"]
        assert 1 <= len(steps) <= 8, path
        assert [s["step_ms"] for s in steps] == sorted((s["step_ms"] for s in steps), reverse=True)
        assert all(-0.5 <= s["at_s"] <= r["duration_s"] + 0.5 for s in steps), (path, steps)
    assert {s["replica"] for s in rows["http"]["slowest_steps"]} == {replica}


def test_cpu_per_token_is_read_for_every_serving_process(results):
    (http,) = [row for row in results["rows"] if row["path"] == "http"]
    us = http["host_cpu_us_per_token"]
    for role in ("proxy", "ingress", "engine"):
        assert us[role] > 0, us
    assert 0 <= us["engine outside steps"] <= us["engine"]
    assert us["serving processes"] == pytest.approx(us["proxy"] + us["ingress"] + us["engine"])
    each = http["host_cpu_us_per_token_by_process"]
    assert sum(v for k, v in each.items() if k.startswith("ingress")) == pytest.approx(
        us["ingress"]
    )
    assert set(http["host_cpu_threads_s"]) >= {"proxy", "ingress", "engine"}
