"""Host-memory LRU of loaded adapter weights (`max_loaded_loras` entries). Plain Python.

Holding weights here makes a slot reload a memory copy instead of a disk read. Pinned adapters are
never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class HostCache(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the host cache needs room for at least one adapter")
        self.capacity = capacity
        self._items: OrderedDict[str, V] = OrderedDict()
        self._pinned: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def peek(self, name: str) -> V | None:
        """Like `get`, without counting as a use."""
        return self._items.get(name)

    def get(self, name: str) -> V | None:
        value = self._items.get(name)
        if value is not None:
            self._items.move_to_end(name)
        return value

    def put(self, name: str, value: V, *, pinned: bool = False) -> list[str]:
        """Insert and return the names evicted to make room (least recently used, unpinned)."""
        self._items[name] = value
        self._items.move_to_end(name)
        if pinned:
            self._pinned.add(name)
        evicted = []
        for old in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if old not in self._pinned and old != name:
                del self._items[old]
                evicted.append(old)
        return evicted

    def remove(self, name: str) -> None:
        self._items.pop(name, None)
        self._pinned.discard(name)
