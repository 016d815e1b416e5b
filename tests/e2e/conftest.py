"""One local Ray cluster with Serve for every end-to-end module: each module deploys its own
application on it (and deletes it when done), so the cluster starts once per test run. The
modules share one xdist group (`serve:e2e`, tests/conftest.py), so they run one after another
on one worker."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_cluster():
    """`{"url": ..., "metrics_url": ...}`: Serve's HTTP proxy and Ray's metrics export on a
    fresh local cluster (CPU only), metrics reported as often as the router benchmark needs."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from app.main import CONTROLLER_OPTIONS
    from benchmarks.bench_router_serve import METRICS_REPORT_INTERVAL_MS

    port, metrics_port = _free_port(), _free_port()
    # Logical CPUs: the largest module deploys five replicas of one CPU each.
    ray.init(
        num_cpus=6,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS
    )
    yield {
        "url": f"http://127.0.0.1:{port}",
        "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
    }
    serve.shutdown()
    ray.shutdown()
