"""The proxy intake benchmark (`benchmarks/bench_proxy_intake.py`) on the shared e2e cluster:
every request of a burst reaches the null ingress, and the figures have their shape. No
timing is asserted."""

from __future__ import annotations

import json
from urllib.parse import urlparse

import pytest

from app.main import CONTROLLER_OPTIONS
from benchmarks.bench_proxy_intake import BATCH, main

pytestmark = pytest.mark.serve


def test_a_burst_reaches_the_ingress_and_is_reported(serve_cluster, tmp_path):
    port = urlparse(serve_cluster["url"]).port
    argv = ["--requests", "24", "--warmup", "4", "--hold-s", "0.2", "--ingress-replicas", "1",
            "--port", str(port), "--out", str(tmp_path), "--name", "intake"]  # fmt: skip
    path = main(argv)
    assert path == tmp_path / "intake.md"
    result = json.loads(path.with_suffix(".json").read_text())
    burst, *fills = result["rows"]
    assert burst["requests"] == 24
    assert 0 <= burst["reached_ingress_first_s"] <= burst["reached_ingress_last_s"]
    assert burst["forward_rate_req_s"] > 0
    # The node's proxy processes were found: in HAProxy mode (the app's), the haproxy too, whose
    # CPU for 24 requests may be under a clock tick.
    assert burst["proxy_cpu_ms_per_request"] >= 0
    ha_mode = CONTROLLER_OPTIONS["runtime_env"]["env_vars"].get("RAY_SERVE_ENABLE_HA_PROXY")
    assert burst["haproxy_processes"] >= (1 if ha_mode == "1" else 0)
    rate = burst["forward_rate_req_s"]
    assert [f["fill_s"] for f in fills] == pytest.approx([n * BATCH / rate for n in (1, 2, 4, 8)])
    assert result["ingress_replicas"] == 1
