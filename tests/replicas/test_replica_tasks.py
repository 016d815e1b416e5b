"""An engine replica's background tasks (stats, leases, ledger, residency): a failure is logged
and the task goes on; a stopped engine ends the task quietly, as it does when a replica shuts
down (its engine stops before the tasks see their cancellation)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from replicas.deployment.replica import _every
from replicas.engine_loop import EngineStopped


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def errors():
    """The errors the replica logs (Serve's logger does not propagate to the root's capture)."""
    handler = _Records()
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(handler)
    yield handler.records
    serve_logger.removeHandler(handler)


async def test_a_failure_is_logged_and_the_task_goes_on(errors):
    calls = 0

    async def work() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("the first read failed")

    task = asyncio.create_task(_every(0.001, work, "reading stats"))
    while calls < 3:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r.getMessage() for r in errors] == ["reading stats failed"]


async def test_a_stopped_engine_ends_the_task_without_an_error(errors):
    calls = 0

    async def work() -> None:
        nonlocal calls
        calls += 1
        raise EngineStopped("the engine stopped")

    await asyncio.wait_for(_every(0.001, work, "publishing residency"), 5)
    assert calls == 1
    assert errors == []
