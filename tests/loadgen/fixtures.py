"""The load generator's fixtures, shared by its tests and the serving benchmark's: a fake
OpenAI server and a virtual-time loop. Each test folder's conftest imports them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadgen import client, runner
from tests.loadgen.fake_server import FakeConfig, serve
from tests.loadgen.virtual_time import VirtualTimeLoop


@pytest.fixture(scope="module")
def fake_url():
    """A default fake server shared by a module's tests; tests that count requests on the
    server start their own with `serve()`."""
    with serve(FakeConfig()) as (url, _):
        yield url


@pytest.fixture
def virtual(monkeypatch):
    """A virtual-time event loop (tests/loadgen/virtual_time.py) whose clock the load
    generator's sender and client read as `time.perf_counter`: run a coroutine on it with
    `virtual.run_until_complete(...)`."""
    loop = VirtualTimeLoop()
    for module in (runner, client):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=loop.time))
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
