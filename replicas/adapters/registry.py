"""Adapter names and their versions: which folder each name serves now, and which versions
requests still use.

Each registration of a name is a new `AdapterVersion` with its own `key`: the identity its
weights, slot and requests go by in the adapter manager. A name resolves to its live version --
one configured at start-up or loaded later (`register`), else `adapter_root/<name>` once a request
names that folder. `unregister` frees the name at once: new requests get 404, and a `register` of
the same name right after makes a new version (a new key, its own weights), while the requests
already holding the old key finish on it (`path` still finds it). Each version counts the requests
that refer to it (`refer` when one is queued, `unrefer` when it ends: no walk over the requests);
`drop` forgets a retired version once that count is 0, which the manager does as soon as the last
one ends, or at the unload when none is left. The key is the name itself unless an older version
still in use holds it (then `name#2`, `name#3`, ...).

Folders are checked cheaply here (config and files, `read_adapter_config`), once a version; a
load's full check of the weights file (`check`) and the weights themselves are the manager's and
the reader's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from replicas.adapters.hub import HubRef, Location, location_of
from replicas.adapters.peft_config import AdapterError, read_adapter_config
from replicas.errors import ErrorKind

Source = Literal["config", "runtime", "adapter_root"]


@dataclass(frozen=True)
class AdapterVersion:
    """One registration of a name."""

    name: str
    path: Location  # a folder, or a hub reference pinned to a commit (downloaded when needed)
    key: str  # unique among the versions not yet dropped
    source: Source
    pinned: bool = False


@dataclass(frozen=True)
class ServedAdapters:
    """What new requests may name: adapters registered by name (configured or loaded at run
    time) and the names unloaded (adapter_root folders included)."""

    adapters: dict[str, str]  # name -> path
    unloaded: tuple[str, ...]  # sorted


class VersionRegistry:
    """An engine replica's names and versions (the ingress keeps its own map of names to
    locations: `app.adapters.AdapterRegistry`). Only the engine thread calls into this object."""

    def __init__(
        self,
        adapters: dict[str, str],
        adapter_root: str | None,
        max_lora_rank: int,
        pinned: Iterable[str] = (),
    ) -> None:
        self.adapter_root = Path(adapter_root) if adapter_root else None
        self.max_lora_rank = max_lora_rank
        self._pinned_names = frozenset(pinned)  # configured pinning, adapter_root names included
        self._live: dict[str, AdapterVersion] = {}  # name -> the version new requests get
        self._versions: dict[str, AdapterVersion] = {}  # key -> every version not dropped
        self.retired: set[str] = set()  # keys of versions unloaded but not dropped yet
        self._refs: dict[str, int] = {}  # key -> requests queued or running on it (absent: 0)
        self.unloaded: set[str] = set()  # names unloaded and not registered again
        self._checked: set[str] = set()  # keys whose folder passed the config check
        self._suffixes = itertools.count(2)
        for name, path in adapters.items():
            self._add(name, location_of(path), "config", pinned=name in self._pinned_names)

    # -- names -> versions ----------------------------------------------------------------------

    def resolve(self, name: str) -> AdapterVersion:
        """The version new requests for `name` get, its folder checked cheaply (config and
        files) the first time. Raises AdapterError: 404 for an unknown or unloaded name, 400
        for unusable files."""
        version = self._live.get(name)
        folder = self._root_folder(name) if version is None and name not in self.unloaded else None
        if folder is not None:
            read_adapter_config(folder, self.max_lora_rank)
            version = self._add(name, folder, "adapter_root", pinned=name in self._pinned_names)
            self._checked.add(version.key)
        if version is None:
            raise AdapterError(f"the model {name!r} does not exist", ErrorKind.NOT_FOUND)
        if version.key not in self._checked:  # configured ones, on their first request
            if isinstance(version.path, Path):  # a hub adapter's files are checked when read
                read_adapter_config(version.path, self.max_lora_rank)
            self._checked.add(version.key)
        return version

    def register(
        self,
        name: str,
        path: str | Location,
        *,
        pinned: bool = False,
        check: Callable[[Path], object] | None = None,
    ) -> AdapterVersion:
        """Serve the adapter at `path` (a folder, or `hf://org/name@<commit>`) as `name` from
        now on, as a new version. `check(path)` (default: the cheap config check) may raise
        AdapterError to refuse a folder; a hub adapter, checked by whoever pinned it, has its
        files checked when they are read. Raises AdapterError: 400 when `name` is live (even
        with requests of an unloaded older version still running, the name is free) or a hub
        reference is not pinned to a commit."""
        if name in self._live:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        try:
            path = location_of(path)
        except ValueError as e:
            raise AdapterError(str(e)) from e
        if isinstance(path, HubRef):
            if not path.pinned:
                raise AdapterError(f"{path} is not pinned to a commit")
        elif check is None:
            read_adapter_config(path, self.max_lora_rank)
        else:
            check(path)
        self.unloaded.discard(name)
        version = self._add(name, path, "runtime", pinned=pinned)
        self._checked.add(version.key)
        return version

    def unregister(self, name: str) -> AdapterVersion | None:
        """Free `name`: new requests get 404 from now on. Returns the version it retired (None
        for an adapter_root folder no request had named yet). Raises AdapterError 404 when
        `name` is not served."""
        version = self._live.pop(name, None)
        if version is not None:
            self.retired.add(version.key)
        elif name in self.unloaded or self._root_folder(name) is None:
            raise AdapterError(f"adapter {name!r} is not loaded", ErrorKind.NOT_FOUND)
        self.unloaded.add(name)
        return version

    def drop(self, key: str) -> None:
        """Forget a retired version: no request refers to it any more."""
        if key in self.retired:
            self.retired.discard(key)
            self._checked.discard(key)
            del self._versions[key]

    # -- the requests' references ---------------------------------------------------------------

    def refer(self, key: str) -> None:
        """A request on version `key` was queued: it is in use until the matching `unrefer`."""
        self._refs[key] = self._refs.get(key, 0) + 1

    def unrefer(self, key: str) -> bool:
        """A request on `key` ended. Returns whether that left a retired version unused (the
        caller drops it)."""
        count = self._refs.get(key, 0)
        if count <= 0:
            raise ValueError(f"adapter version {key!r} released more often than referred to")
        if count == 1:
            del self._refs[key]
            return key in self.retired
        self._refs[key] = count - 1
        return False

    def references(self, key: str) -> int:
        """Requests queued or running on version `key`."""
        return self._refs.get(key, 0)

    # -- versions -------------------------------------------------------------------------------

    def path(self, key: str) -> Location:
        """The folder (or hub reference) of a version (retired ones included). Raises
        AdapterError 404 for a key no version has (dropped)."""
        version = self._versions.get(key)
        if version is None:
            raise AdapterError(f"adapter version {key!r} no longer exists", ErrorKind.NOT_FOUND)
        return version.path

    def name_of(self, key: str) -> str:
        """The name a version serves (the key itself for a key no version has)."""
        version = self._versions.get(key)
        return key if version is None else version.name

    def is_pinned(self, key: str) -> bool:
        """Pinned and live (unloading unpins)."""
        version = self._versions.get(key)
        return version is not None and version.pinned and key not in self.retired

    def is_retired(self, key: str) -> bool:
        return key in self.retired

    def keys(self) -> set[str]:
        """Every version's key, live or retired."""
        return set(self._versions)

    def served(self) -> ServedAdapters:
        adapters = {
            name: str(version.path)
            for name, version in self._live.items()
            if version.source != "adapter_root"
        }
        return ServedAdapters(adapters, tuple(sorted(self.unloaded)))

    # -- internals ------------------------------------------------------------------------------

    def _add(self, name: str, path: Location, source: Source, *, pinned: bool) -> AdapterVersion:
        key = name
        while key in self._versions:  # an older version of the name (or a name like it) holds it
            key = f"{name}#{next(self._suffixes)}"
        version = AdapterVersion(name, path, key, source, pinned)
        self._versions[key] = version
        self._live[name] = version
        return version

    def _root_folder(self, name: str) -> Path | None:
        """`adapter_root / name`, when that is a folder and `name` a plain name."""
        if self.adapter_root is None or not _plain_name(name):
            return None
        folder = self.adapter_root / name
        return folder if folder.is_dir() else None


def _plain_name(name: str) -> bool:
    return "/" not in name and "\\" not in name and name not in ("", ".", "..")
