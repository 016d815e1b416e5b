"""Host-memory LRU of loaded adapter weights: at most `capacity` entries (`max_loaded_loras`)
and, when given, at most `max_bytes` of them (adapters differ in size by two orders of
magnitude, so a count alone bounds memory poorly). Plain Python.

Holding weights here makes a slot reload a memory copy instead of a disk read. Pinned adapters are
never evicted, and the entry just put is kept even when it alone exceeds the byte budget (the
request that needs it could not run otherwise).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class HostCache(Generic[V]):
    def __init__(
        self,
        capacity: int,
        max_bytes: int | None = None,
        size: Callable[[V], int] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("the host cache needs room for at least one adapter")
        if max_bytes is not None and (max_bytes < 1 or size is None):
            raise ValueError("a byte budget needs to be positive and a size function")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[str, V] = OrderedDict()
        self._pinned: set[str] = set()
        self.nbytes = 0  # of the entries held, when a size function is given

    def _over(self) -> bool:
        if len(self._items) > self.capacity:
            return True
        return self.max_bytes is not None and self.nbytes > self.max_bytes

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
        replaced = self._items.pop(name, None)
        if replaced is not None:
            self.nbytes -= self._bytes(replaced)
        self._items[name] = value
        self.nbytes += self._bytes(value)
        if pinned:
            self._pinned.add(name)
        evicted = []
        for old in list(self._items):
            if not self._over():
                break
            if old not in self._pinned and old != name:
                self.nbytes -= self._bytes(self._items.pop(old))
                evicted.append(old)
        return evicted

    def remove(self, name: str) -> None:
        value = self._items.pop(name, None)
        if value is not None:
            self.nbytes -= self._bytes(value)
        self._pinned.discard(name)

    def _bytes(self, value: V) -> int:
        return self._size(value) if self._size is not None else 0
