"""The fleet's record of adapters loaded and unloaded at run time, so that an engine replica
that starts later (a restart, a scale-up) serves what the others serve. Plain Python; the store
is injected (`LedgerStore`: Ray's GCS key-value store under Serve, `MemoryLedger` in tests).

Why a store outside the replicas: a runtime load reaches the replicas running at that moment
(a broadcast), and lives in their memory. A replica that starts later, or a fleet that loses
every replica at once, would fall back to the app config. The ingress writes each change to a
store that outlives every replica (the newest `ENTRIES_KEPT` versions per name, the newest the
last word on it), and each engine replica reads it at start-up and again every few seconds
(`reconcile`).

Ordering: each change carries a `version` (the writer's wall clock, in ns) that the broadcast
carries too, and a replica remembers the version it last applied per name, so an older entry
never undoes a newer broadcast. The ingress writes a load after the broadcast succeeded (a
failed load leaves no entry) and an unload before its broadcast (a replica that re-reads the
store meanwhile never brings the name back).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from replicas.errors import ErrorKind, ServingError


@dataclass(frozen=True)
class AdapterEntry:
    """The fleet's last word on one name: served from `path` (pinned or not), or unloaded
    (`path` None), as of `version`. `load_id` is the load that registered it."""

    name: str
    path: str | None
    version: int
    pinned: bool = False
    load_id: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an adapter entry needs a name")
        if self.path is None and self.pinned:
            raise ValueError("an unloaded adapter cannot be pinned")

    @property
    def unloaded(self) -> bool:
        return self.path is None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AdapterEntry:
        return cls(**json.loads(data))


class LedgerStore(Protocol):
    """Entries by name and version; `read_all` gives each name's newest, skipping entries it
    cannot parse. Several ingress replicas write at once, so an entry is never overwritten: a
    write adds one (an older one written late stays hidden behind the newer), and `retract`
    takes back one entry (the name's previous newest shows again). Calls block (a network
    store): run them off the event loop."""

    def read_all(self) -> dict[str, AdapterEntry]: ...

    def write(self, entry: AdapterEntry) -> None: ...

    def retract(self, entry: AdapterEntry) -> None: ...


ENTRIES_KEPT = 3  # versions kept per name: a retraction falls back to the one before


def newest(entries: list[AdapterEntry]) -> dict[str, AdapterEntry]:
    """Each name's newest entry."""
    out: dict[str, AdapterEntry] = {}
    for entry in entries:
        if entry.name not in out or entry.version > out[entry.name].version:
            out[entry.name] = entry
    return out


class MemoryLedger:
    """A `LedgerStore` in this process's memory."""

    def __init__(self) -> None:
        self._versions: dict[str, dict[int, AdapterEntry]] = {}

    def read_all(self) -> dict[str, AdapterEntry]:
        return newest([e for versions in self._versions.values() for e in versions.values()])

    def write(self, entry: AdapterEntry) -> None:
        versions = self._versions.setdefault(entry.name, {})
        versions[entry.version] = entry
        for version in sorted(versions)[:-ENTRIES_KEPT]:
            del versions[version]

    def retract(self, entry: AdapterEntry) -> None:
        self._versions.get(entry.name, {}).pop(entry.version, None)


@dataclass(frozen=True)
class Unload:
    name: str


@dataclass(frozen=True)
class Load:
    name: str
    path: str
    pinned: bool
    load_id: str | None


def reconcile(
    entries: dict[str, AdapterEntry], served: dict[str, str], applied: dict[str, int]
) -> list[tuple[AdapterEntry, list[Unload | Load]]]:
    """What a replica must do to agree with the ledger: for each entry newer than the version
    it last applied for that name (`applied`), the steps that take `served` (name -> path, what
    it serves by name now) there. An entry already matched still comes back, with no steps, so
    the caller records its version."""
    plan: list[tuple[AdapterEntry, list[Unload | Load]]] = []
    for name, entry in sorted(entries.items()):
        if entry.version <= applied.get(name, 0):
            continue
        steps: list[Unload | Load] = []
        if entry.path is None:  # unloaded
            steps.append(Unload(name))  # also names under adapter_root not used yet
        elif served.get(name) != entry.path:
            if name in served:
                steps.append(Unload(name))
            steps.append(Load(name, entry.path, entry.pinned, entry.load_id))
        plan.append((entry, steps))
    return plan


class AdapterEngine(Protocol):
    """What `LedgerFollower` needs of the engine (`replicas.engine.Engine`): its load and unload
    raise a `ServingError` (NOT_FOUND: not served) when refused."""

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def served_adapters(self) -> Any: ...  # `.adapters`: {name: path}


class LoadMismatch(ServingError, LookupError):
    """An undo (`unload(name, load_id)`) of a load that is not what registered `name` here."""

    default_kind = ErrorKind.NOT_FOUND


class Superseded(ServingError, LookupError):
    """An unload that finds, as of its version, the name not loaded here: it is older than the
    last change applied to the name, or a catch-up applied its version first and found nothing
    to unload."""

    default_kind = ErrorKind.NOT_FOUND


class LedgerFollower:
    """One replica's side of the ledger: the loads and unloads it is told of (broadcasts), and
    `follow(entries)` to catch up with the store. Every method calls the engine, so all run on
    the engine's thread, one at a time (`AsyncEngine.call`): a broadcast and a catch-up never
    interleave.

    `applied` holds, per name, the version of the last change made here; `load_ids` the load
    that registered each name, so that undoing a partial load never removes an adapter that
    another load registered."""

    def __init__(self) -> None:
        self.applied: dict[str, int] = {}
        self.load_ids: dict[str, str] = {}
        # name -> `applied` before the load in `load_ids` (its broadcast): what an undo puts back
        self._before_load: dict[str, int | None] = {}
        self.failures: dict[str, str] = {}  # name -> why its latest entry could not be applied
        # name -> the version of an unload a catch-up applied without finding the name served
        self._found_absent: dict[str, int] = {}

    def load(
        self,
        engine: AdapterEngine,
        name: str,
        path: str,
        pinned: bool = False,
        load_id: str | None = None,
        version: int | None = None,
    ) -> None:
        """A load older than the last change applied to `name` here, which finds the name not
        served (an unload broadcast later by another ingress came first), is done: it was
        undone since. Served, the engine refuses it as a name in use."""
        if version is not None and version < self.applied.get(name, 0):
            if name not in engine.served_adapters().adapters:
                return
        engine.load_adapter(name, path, pinned)
        if load_id is not None:
            self._before_load[name] = self.applied.get(name)
        self._loaded(name, load_id, version)

    def unload(
        self,
        engine: AdapterEngine,
        name: str,
        load_id: str | None = None,
        version: int | None = None,
    ) -> None:
        """With `load_id` (undoing a partial load): only when that load registered `name` here
        (else LoadMismatch), and the version it applied is taken back. A `version` already
        applied here (the replica caught up with the store first) is done, unless that catch-up
        found the name not served; one older than the last change applied here is Superseded
        (as of it, the name was not loaded here)."""
        if version is not None:
            if self.applied.get(name) == version:
                if self._found_absent.get(name) == version:
                    raise Superseded(f"The lora adapter '{name}' cannot be found.")
                return
            if version < self.applied.get(name, 0):
                raise Superseded(f"The lora adapter '{name}' cannot be found.")
        if load_id is not None and self.load_ids.get(name) != load_id:
            raise LoadMismatch(f"adapter {name!r} was not loaded by load {load_id}")
        engine.unload_adapter(name)
        self.load_ids.pop(name, None)
        undo = load_id is not None and name in self._before_load  # `load_id`'s, checked above
        before = self._before_load.pop(name, None)
        if undo:
            if before is None:
                self.applied.pop(name, None)
            else:
                self.applied[name] = before
        if version is not None:
            self.applied[name] = max(version, self.applied.get(name, 0))

    def follow(self, engine: AdapterEngine, entries: dict[str, AdapterEntry]) -> list[str]:
        """Apply the entries newer than what this replica applied; returns the names changed
        here. A step that fails leaves its entry to the next catch-up (its reason kept in
        `failures`); an unload of a name not served here is no failure."""
        changed: list[str] = []
        served = dict(engine.served_adapters().adapters)
        for entry, steps in reconcile(entries, served, self.applied):
            removed = True
            try:
                for step in steps:
                    if isinstance(step, Unload):
                        removed = self._unload_quietly(engine, step.name)
                    else:
                        engine.load_adapter(step.name, step.path, step.pinned)
            except Exception as e:
                self.failures[entry.name] = str(e)
                continue
            self.failures.pop(entry.name, None)
            self._before_load.pop(entry.name, None)  # no undo of an earlier load reaches past
            if entry.unloaded:
                self.load_ids.pop(entry.name, None)
                self.applied[entry.name] = entry.version
                if not removed:  # its own broadcast, arriving later, must say so (404)
                    self._found_absent[entry.name] = entry.version
            else:
                self._loaded(entry.name, entry.load_id, entry.version)
            if steps:
                changed.append(entry.name)
        return changed

    def _unload_quietly(self, engine: AdapterEngine, name: str) -> bool:
        """Unload `name`; False when it was not served here."""
        try:
            engine.unload_adapter(name)
        except Exception as e:
            if not (isinstance(e, ServingError) and e.kind is ErrorKind.NOT_FOUND):
                raise
            return False
        finally:
            self.load_ids.pop(name, None)
        return True

    def _loaded(self, name: str, load_id: str | None, version: int | None) -> None:
        if load_id is not None:
            self.load_ids[name] = load_id
        else:
            self.load_ids.pop(name, None)
        if version is not None:
            self.applied[name] = max(version, self.applied.get(name, 0))
