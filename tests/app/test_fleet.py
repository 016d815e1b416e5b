"""ServeFleetClient's writes to the fleet's adapter ledger, over a fake deployment handle: what a
replica that starts later reads (replicas/adapter_ledger.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.fleet import REPLICA_FAILED, ServeFleetClient
from replicas.adapter_ledger import AdapterEntry, MemoryLedger
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind


class FakeBroadcast:
    def __init__(self, answers: list) -> None:
        self.answers = answers

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list:
        assert return_exceptions
        return self.answers


class FakeHandle:
    """Each replica is a function of (method, *args) that returns its answer or raises."""

    def __init__(self, *replicas) -> None:
        self.replicas = list(replicas)
        self.calls: list[tuple] = []

    def broadcast(self, method: str, *args) -> FakeBroadcast:
        self.calls.append((method, *args))
        answers = []
        for replica in self.replicas:
            try:
                answers.append(replica(method, *args))
            except Exception as e:
                answers.append(e)
        return FakeBroadcast(answers)


@pytest.fixture(autouse=True)
def outside_ray(monkeypatch):
    """Asked outside an actor, Ray would start a local cluster (seconds of both cores) to say
    that this process has no actor id."""
    monkeypatch.setattr("app.fleet.caller_id", lambda: None)


def accepts(method, *args):
    return None


def refuses(method, *args):
    raise RequestRejected("cannot read adapter weights", ErrorKind.INVALID)


def knows_nothing(method, *args):
    if method == "unload_adapter":
        raise RequestRejected("The lora adapter 'x' cannot be found.", ErrorKind.NOT_FOUND)


class BrokenLedger(MemoryLedger):
    def write(self, entry: AdapterEntry) -> None:
        raise OSError("the GCS is unreachable")


async def test_a_load_every_replica_took_is_recorded_with_the_version_they_were_sent():
    ledger = MemoryLedger()
    handle = FakeHandle(accepts, accepts)
    replies = await ServeFleetClient(handle, ledger=ledger).broadcast_load_adapter(
        "sql", "/adapters/sql", True, "load-1"
    )
    assert all(r.ok for r in replies) and len(replies) == 2
    (_, name, path, pinned, load_id, version) = handle.calls[0]
    assert ledger.read_all() == {"sql": AdapterEntry(name, path, version, pinned, load_id)}
    assert (name, path, pinned, load_id) == ("sql", "/adapters/sql", True, "load-1")


async def test_a_load_a_replica_refused_is_not_recorded():
    ledger = MemoryLedger()
    fleet = ServeFleetClient(FakeHandle(accepts, refuses), ledger=ledger)
    replies = await fleet.broadcast_load_adapter("sql", "/adapters/sql", False, "load-1")
    assert [r.ok for r in replies] == [True, False]
    assert (
        replies[1].kind is ErrorKind.INVALID and replies[1].reason == "cannot read adapter weights"
    )
    # The undo, a broadcast naming that load, leaves the ledger alone too.
    await fleet.broadcast_unload_adapter("sql", "load-1")
    assert ledger.read_all() == {}


async def test_an_unload_is_recorded_before_any_replica_hears_of_it():
    ledger = MemoryLedger()
    ledger.write(AdapterEntry("sql", "/adapters/sql", 1, False, "load-1"))
    seen = []

    def replica(method, *args):
        seen.append(ledger.read_all()["sql"])  # what a replica starting now would read
        return None

    await ServeFleetClient(FakeHandle(replica), ledger=ledger).broadcast_unload_adapter("sql")
    (entry,) = seen
    assert entry.path is None and entry.version > 1
    assert ledger.read_all()["sql"] == entry


@pytest.mark.parametrize("before", [None, AdapterEntry("sql", "/adapters/sql", 1, True, "l1")])
async def test_an_unload_no_replica_acted_on_puts_the_ledger_back(before):
    ledger = MemoryLedger()
    if before is not None:
        ledger.write(before)
    fleet = ServeFleetClient(FakeHandle(knows_nothing, knows_nothing), ledger=ledger)
    replies = await fleet.broadcast_unload_adapter("sql")
    assert [r.kind for r in replies] == [ErrorKind.NOT_FOUND] * 2
    assert ledger.read_all().get("sql") == before


async def test_a_failing_ledger_does_not_fail_the_load():
    fleet = ServeFleetClient(FakeHandle(accepts), ledger=BrokenLedger())
    replies = await fleet.broadcast_load_adapter("sql", "/adapters/sql", False, "load-1")
    assert [r.ok for r in replies] == [True]


async def test_a_dead_replica_is_reported_without_rays_internals():
    def dead(method, *args):
        raise RuntimeError("The actor died. class_name: EngineDeployment, actor_id: ab12, pid: 7")

    (reply,) = await ServeFleetClient(FakeHandle(dead), ledger=MemoryLedger())._broadcast(
        1.0, "adapter_report", 0.5
    )
    assert reply.reason == REPLICA_FAILED
    assert "actor_id: ab12" in reply.detail  # for the log


def test_the_ledger_is_read_without_importing_the_engine():
    """An ingress's first ledger read (a client listing adapters) imports `RayLedger`; the
    engine and torch with it would hold its loop's GIL for seconds."""
    code = """
import sys
from app.fleet import ServeFleetClient
from replicas.deployment import RayLedger
assert RayLedger("app", "Engine").prefix == "adapters::app::Engine::"
for name in ("replicas.engine", "replicas.deployment.replica", "torch"):
    assert name not in sys.modules, name
from replicas.deployment import EngineDeployment
assert "replicas.engine" in sys.modules and EngineDeployment.name == "EngineDeployment"
"""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
