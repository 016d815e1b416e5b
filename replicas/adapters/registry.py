"""Adapter names: which folder each name serves, and which names new requests may still use.

A name resolves to an adapter registered at start-up or later (`register`), else to
`adapter_root/<name>` when that folder exists. `unregister` retires a name: new requests get 404
at once, while requests already queued or running finish with it (`path` still finds it);
`forget` drops it once no request refers to it. Folders are checked cheaply here (config and
files, `read_adapter_config`); the weights are read later, by the reader.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from replicas.adapters.loader import AdapterError, read_adapter_config


@dataclass(frozen=True)
class ServedAdapters:
    """What new requests may name: adapters registered by name (configured or loaded at run
    time) and the names unloaded (adapter_root folders included)."""

    adapters: dict[str, str]  # name -> path
    unloaded: tuple[str, ...]  # sorted


class AdapterRegistry:
    def __init__(
        self,
        adapters: dict[str, str],
        adapter_root: str | None,
        max_lora_rank: int,
        pinned: Iterable[str] = (),
    ) -> None:
        self.adapter_root = Path(adapter_root) if adapter_root else None
        self.max_lora_rank = max_lora_rank
        self.paths: dict[str, Path] = {name: Path(p) for name, p in adapters.items()}
        self.pinned: set[str] = set(pinned)
        self.retired: dict[str, Path] = {}  # unloaded, still used by queued or running requests
        self.unloaded: set[str] = set()  # names new requests may not use

    def resolve(self, name: str) -> Path:
        """The folder of an adapter new requests may use, checked cheaply (config and files).
        Raises AdapterError: 404 for an unknown or unloaded name, 400 for unusable files."""
        path = self.paths.get(name)
        if path is None and name not in self.unloaded and self._under_root(name):
            path = self.adapter_root / name
        if path is None:
            raise AdapterError(f"the model {name!r} does not exist", status=404)
        read_adapter_config(path, self.max_lora_rank)
        return path

    def path(self, name: str) -> Path:
        """Where a queued request's adapter lives, retired ones included. Raises AdapterError."""
        if name in self.retired:
            return self.retired[name]
        return self.resolve(name)

    def register(self, name: str, path: str | Path, *, pinned: bool = False) -> None:
        """Serve the adapter at `path` as `name` from now on. Raises AdapterError."""
        if name in self.paths or name in self.retired:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        read_adapter_config(path, self.max_lora_rank)
        self.paths[name] = Path(path)
        self.unloaded.discard(name)
        if pinned:
            self.pinned.add(name)

    def unregister(self, name: str) -> None:
        """Retire `name`: new requests may not use it from now on. Raises AdapterError 404 when
        it is not served."""
        if name in self.paths:
            self.retired[name] = self.paths.pop(name)
        elif name not in self.unloaded and self._under_root(name):
            self.retired[name] = self.adapter_root / name
        else:
            raise AdapterError(f"adapter {name!r} is not loaded", status=404)
        self.unloaded.add(name)
        self.pinned.discard(name)

    def forget(self, name: str) -> None:
        """A retired name that no request refers to any more."""
        self.retired.pop(name, None)

    def unused_retired(self, in_use: set[str | None]) -> list[str]:
        return [name for name in self.retired if name not in in_use]

    def is_pinned(self, name: str) -> bool:
        return name in self.pinned

    def names(self) -> set[str]:
        """Every name registered or retired (adapter_root folders only once used elsewhere)."""
        return set(self.paths) | set(self.retired)

    def served(self) -> ServedAdapters:
        return ServedAdapters(
            {name: str(path) for name, path in self.paths.items()}, tuple(sorted(self.unloaded))
        )

    def _under_root(self, name: str) -> bool:
        return (
            self.adapter_root is not None
            and _plain_name(name)
            and (self.adapter_root / name).is_dir()
        )


def _plain_name(name: str) -> bool:
    return "/" not in name and "\\" not in name and name not in ("", ".", "..")
