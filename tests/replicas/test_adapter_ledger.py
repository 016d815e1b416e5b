"""The runtime adapter ledger (replicas/adapter_ledger.py): what a replica does to agree with it,
against a fake engine with the real engine's refusals (name in use, 404 when not served)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from replicas.adapter_ledger import (
    ENTRIES_KEPT,
    AdapterEntry,
    LedgerFollower,
    Load,
    LoadMismatch,
    MemoryLedger,
    Superseded,
    Unload,
    reconcile,
)
from replicas.errors import ErrorKind, ServingError


class Refused(ServingError):
    """The fake engine's refusal, as the engine's own (`RequestRejected`) carries it."""


@dataclass
class Served:
    adapters: dict[str, str]


class FakeEngine:
    """Names served by path; `retired` names are unloaded but still used by a request."""

    def __init__(self, adapters: dict[str, str] | None = None) -> None:
        self.adapters = dict(adapters or {})
        self.retired: set[str] = set()
        self.broken: set[str] = set()  # paths whose files are bad

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        if name in self.adapters or name in self.retired:
            raise Refused(f"adapter {name!r} is already loaded", ErrorKind.INVALID)
        if path in self.broken:
            raise Refused(f"no adapter_config.json in {path}", ErrorKind.INVALID)
        self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise Refused(f"adapter {name!r} is not loaded", ErrorKind.NOT_FOUND)
        del self.adapters[name]

    def served_adapters(self) -> Served:
        return Served(dict(self.adapters))


class TestReconcile:
    def test_steps_take_the_served_names_to_the_ledgers(self):
        entries = {
            "new": AdapterEntry("new", "/a/new", 5, pinned=True, load_id="l1"),
            "gone": AdapterEntry("gone", None, 6),
            "moved": AdapterEntry("moved", "/b/moved", 7),
            "same": AdapterEntry("same", "/a/same", 8),
            "old": AdapterEntry("old", None, 2),
        }
        served = {"gone": "/a/gone", "moved": "/a/moved", "same": "/a/same", "old": "/a/old"}
        plan = dict((entry.name, steps) for entry, steps in reconcile(entries, served, {"old": 3}))
        assert plan == {
            "new": [Load("new", "/a/new", True, "l1")],
            "gone": [Unload("gone")],
            "moved": [Unload("moved"), Load("moved", "/b/moved", False, None)],
            "same": [],  # matched already: only its version to record
        }  # "old": this replica applied a newer change than the entry


class TestLedgerFollower:
    def test_a_new_replica_catches_up_with_loads_and_unloads(self):
        ledger = MemoryLedger()
        ledger.write(AdapterEntry("runtime", "/a/runtime", 10, load_id="l1"))
        ledger.write(AdapterEntry("configured", None, 11))  # unloaded at run time
        engine = FakeEngine({"configured": "/a/configured", "kept": "/a/kept"})
        follower = LedgerFollower()
        assert sorted(follower.follow(engine, ledger.read_all())) == ["configured", "runtime"]
        assert engine.adapters == {"kept": "/a/kept", "runtime": "/a/runtime"}
        assert follower.applied == {"runtime": 10, "configured": 11}
        # Undoing that load by its id works on this replica too.
        follower.unload(engine, "runtime", "l1")
        assert "runtime" not in engine.adapters

    def test_an_older_entry_never_undoes_a_newer_broadcast(self):
        ledger = MemoryLedger()
        ledger.write(AdapterEntry("x", None, 20))  # read by the catch-up below...
        engine = FakeEngine()
        follower = LedgerFollower()
        follower.load(engine, "x", "/a/x", version=21)  # ...after a later load reached it
        assert follower.follow(engine, ledger.read_all()) == []
        assert engine.adapters == {"x": "/a/x"}

    def test_an_unload_the_replica_already_caught_up_with_succeeds(self):
        engine = FakeEngine({"x": "/a/x"})
        follower = LedgerFollower()
        follower.follow(engine, {"x": AdapterEntry("x", None, 30)})
        assert engine.adapters == {}
        follower.unload(engine, "x", version=30)  # the broadcast of the same unload: done
        with pytest.raises(Refused) as e:
            follower.unload(engine, "x", version=31)
        assert e.value.kind is ErrorKind.NOT_FOUND

    def test_an_unload_of_nothing_the_replica_caught_up_with_first_is_still_404(self):
        """The ingress writes the unload to the ledger before it broadcasts it: a catch-up in
        between applies it first. When there was nothing to unload, the broadcast still says
        so (it once answered 200 to an unload of a name never loaded)."""
        engine = FakeEngine()
        follower = LedgerFollower()
        follower.follow(engine, {"never": AdapterEntry("never", None, 35)})
        with pytest.raises(Superseded) as e:
            follower.unload(engine, "never", version=35)
        assert e.value.kind is ErrorKind.NOT_FOUND and "never" in str(e.value)

    def test_a_failed_entry_is_retried_and_its_reason_kept(self):
        engine = FakeEngine()
        engine.retired.add("x")  # an unloaded "x" still finishing a request
        follower = LedgerFollower()
        entries = {"x": AdapterEntry("x", "/a/x2", 40)}
        assert follower.follow(engine, entries) == []
        assert "already loaded" in follower.failures["x"] and "x" not in follower.applied
        engine.retired.clear()
        assert follower.follow(engine, entries) == ["x"]
        assert follower.failures == {} and engine.adapters == {"x": "/a/x2"}

    def test_an_unload_of_a_name_not_served_here_is_no_failure(self):
        follower = LedgerFollower()
        engine = FakeEngine()
        follower.follow(engine, {"never": AdapterEntry("never", None, 50)})
        assert follower.failures == {} and follower.applied == {"never": 50}

    def test_undoing_someone_elses_load_is_refused(self):
        engine = FakeEngine()
        follower = LedgerFollower()
        follower.load(engine, "x", "/a/x", load_id="mine")
        with pytest.raises(LoadMismatch):
            follower.unload(engine, "x", "theirs")
        assert engine.adapters == {"x": "/a/x"}


class TestRacingBroadcasts:
    """Two ingresses broadcast changes of one name; each replica may get them in either order.
    Whatever the order, a replica ends as the newer change says."""

    def test_a_load_that_arrives_after_a_newer_unload_is_already_undone(self):
        engine, follower = FakeEngine(), LedgerFollower()
        follower.load(engine, "x", "/a/x", load_id="l0", version=5)
        follower.unload(engine, "x", version=20)  # took x out
        follower.load(engine, "x", "/b/x", load_id="l1", version=10)  # broadcast before it
        assert engine.adapters == {} and follower.applied["x"] == 20

    def test_a_load_that_crossed_an_unload_of_nothing_is_taken_out_by_the_ledger(self):
        engine, follower = FakeEngine(), LedgerFollower()
        with pytest.raises(Refused):  # the unload (version 20) first: nothing to unload here
            follower.unload(engine, "x", version=20)
        follower.load(engine, "x", "/a/x", load_id="l1", version=10)  # then the older load
        assert engine.adapters == {"x": "/a/x"}  # for now; the ledger has the unload last
        ledger = MemoryLedger()
        ledger.write(AdapterEntry("x", None, 20))
        ledger.write(AdapterEntry("x", "/a/x", 10, load_id="l1"))  # recorded late: hidden
        assert follower.follow(engine, ledger.read_all()) == ["x"]
        assert engine.adapters == {} and follower.applied["x"] == 20

    def test_undoing_a_load_takes_back_its_version(self):
        engine, follower = FakeEngine(), LedgerFollower()
        follower.load(engine, "x", "/a/x", load_id="l1", version=10)
        follower.unload(engine, "x", load_id="l1")  # it failed elsewhere
        assert engine.adapters == {} and "x" not in follower.applied
        ledger = MemoryLedger()
        ledger.write(AdapterEntry("x", "/b/x", 5, load_id="l0"))  # what the fleet serves
        assert follower.follow(engine, ledger.read_all()) == ["x"]
        assert engine.adapters == {"x": "/b/x"}

    def test_an_unload_that_arrives_after_a_newer_load_is_superseded(self):
        engine, follower = FakeEngine(), LedgerFollower()
        follower.load(engine, "x", "/a/x", load_id="l1", version=20)
        with pytest.raises(Superseded) as refused:
            follower.unload(engine, "x", version=10)
        assert refused.value.kind is ErrorKind.NOT_FOUND  # as of version 10, "x" was not loaded
        assert engine.adapters == {"x": "/a/x"}

    def test_in_order_both_apply(self):
        engine, follower = FakeEngine(), LedgerFollower()
        follower.load(engine, "x", "/a/x", version=10)
        follower.unload(engine, "x", version=20)
        follower.load(engine, "x", "/b/x", version=30)
        assert engine.adapters == {"x": "/b/x"}


class TestLedgerStores:
    def test_a_late_older_write_stays_hidden_and_a_retraction_falls_back(self, store):
        older = AdapterEntry("x", "/a/x", 10, load_id="l1")
        tombstone = AdapterEntry("x", None, 20)
        store.write(tombstone)
        store.write(older)  # its broadcast began first but it is recorded last
        assert store.read_all() == {"x": tombstone}
        store.retract(tombstone)
        assert store.read_all() == {"x": older}
        store.retract(older)
        assert store.read_all() == {}

    def test_each_name_keeps_its_newest_entries(self, store):
        for version in range(1, 10):
            store.write(AdapterEntry("x", f"/a/{version}", version))
        store.write(AdapterEntry("x@y", "/a/xy", 1))  # a name that extends "x@"
        for version in range(9, 9 - ENTRIES_KEPT, -1):
            assert store.read_all()["x"].version == version
            store.retract(AdapterEntry("x", None, version))
        assert "x" not in store.read_all() and store.read_all()["x@y"].path == "/a/xy"


class FakeKV:
    """Ray's internal KV functions over a dict (keys and values as bytes, as Ray returns them)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def put(self, key, value, overwrite=True, namespace=None):
        key = key.encode() if isinstance(key, str) else key
        self.data[key] = value

    def get(self, key, namespace=None):
        return self.data.get(key.encode() if isinstance(key, str) else key)

    def list(self, prefix, namespace=None):
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        return [k for k in self.data if k.startswith(prefix)]

    def delete(self, key, namespace=None):
        self.data.pop(key.encode() if isinstance(key, str) else key, None)


@pytest.fixture(params=["memory", "ray"])
def store(request, monkeypatch):
    if request.param == "memory":
        return MemoryLedger()
    from ray.experimental import internal_kv

    from replicas.deployment import RayLedger

    kv = FakeKV()
    monkeypatch.setattr(internal_kv, "_internal_kv_put", kv.put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", kv.get)
    monkeypatch.setattr(internal_kv, "_internal_kv_list", kv.list)
    monkeypatch.setattr(internal_kv, "_internal_kv_del", kv.delete)
    return RayLedger("app", "EngineDeployment")


def test_entries_round_trip_and_check_themselves():
    entry = AdapterEntry("x", "/a/x", 7, pinned=True, load_id="l")
    assert AdapterEntry.from_json(entry.to_json()) == entry
    with pytest.raises(ValueError):
        AdapterEntry("x", None, 1, pinned=True)
