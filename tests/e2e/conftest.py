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
    """`{"url": ...}` of Serve's HTTP proxy on a fresh local cluster (CPU only)."""
    ray = pytest.importorskip("ray")
    from ray import serve

    port = _free_port()
    # Logical CPUs: the largest module deploys five replicas of one CPU each.
    ray.init(num_cpus=6, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"url": f"http://127.0.0.1:{port}"}
    serve.shutdown()
    ray.shutdown()
