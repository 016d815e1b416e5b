from __future__ import annotations

import pytest

from tests.benchmarks.fake_server import FakeConfig, serve


@pytest.fixture(scope="module")
def fake_url():
    """A default fake server shared by a module's tests; tests that count requests on the
    server start their own with `serve()`."""
    with serve(FakeConfig()) as (url, _):
        yield url
