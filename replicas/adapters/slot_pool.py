"""GPU slot pool policy: which adapter sits in which slot, and which slot to give up next.
Plain Python, no torch; the weight buffers are filled by `replicas.lora.LoraWeightPool`.

Rules:
- An adapter held by a running request (`hold` count > 0) is never evicted.
- A pinned adapter is never evicted.
- Among the others, the eviction policy picks: "lru" (default) gives up the least recently
  used first; "lfu" the least often used (fewest requests since it was loaded), the least
  recent among equals. LFU keeps a steady popular set through bursts of one-off adapters; LRU
  follows a shifting working set sooner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class NoFreeSlot(RuntimeError):
    """Every slot is held by a running request or pinned."""


@dataclass
class _Entry:
    slot: int
    holds: int = 0
    pinned: bool = False
    uses: int = 0  # holds taken since the adapter got its slot


# Eviction order among evictable adapters, given them least recently used first.
EVICTION_POLICIES: dict[str, Callable[[list[tuple[str, _Entry]]], list[tuple[str, _Entry]]]] = {
    "lru": lambda entries: entries,
    "lfu": lambda entries: sorted(entries, key=lambda item: item[1].uses),  # stable: LRU ties
}


@dataclass(frozen=True)
class Assignment:
    slot: int
    evicted: str | None  # the adapter that lived in the slot before, if any


class SlotPool:
    def __init__(self, num_slots: int, policy: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError("the slot pool needs at least one slot")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {sorted(EVICTION_POLICIES)}")
        self.num_slots = num_slots
        self._order = EVICTION_POLICIES[policy]
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def slot_of(self, name: str) -> int | None:
        entry = self._entries.get(name)
        return None if entry is None else entry.slot

    def holds(self, name: str) -> int:
        entry = self._entries.get(name)
        return 0 if entry is None else entry.holds

    @property
    def resident(self) -> dict[str, int]:
        return {name: e.slot for name, e in self._entries.items()}

    @property
    def num_held(self) -> int:
        return sum(1 for e in self._entries.values() if e.holds > 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_assign(self) -> bool:
        return bool(self._free) or any(self.evictable())

    def evictable(self) -> Iterator[str]:
        """Resident adapters that may be evicted, the first to go first."""
        candidates = [(n, e) for n, e in self._entries.items() if e.holds == 0 and not e.pinned]
        return (n for n, _ in self._order(candidates))

    def assign(self, name: str, *, pinned: bool = False) -> Assignment:
        """Give `name` a slot: a free one, else the first evictable one."""
        if name in self._entries:
            raise ValueError(f"adapter {name!r} already has slot {self._entries[name].slot}")
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next(self.evictable(), None)
            if evicted is None:
                raise NoFreeSlot(f"all {self.num_slots} adapter slots are in use")
            slot = self._entries.pop(evicted).slot
        self._entries[name] = _Entry(slot=slot, pinned=pinned)
        return Assignment(slot=slot, evicted=evicted)

    def hold(self, name: str) -> int:
        """A running request starts using `name`; returns its slot and marks it most recent."""
        entry = self._entries[name]
        entry.holds += 1
        entry.uses += 1
        self._entries.move_to_end(name)
        return entry.slot

    def release(self, name: str) -> None:
        entry = self._entries[name]
        if entry.holds <= 0:
            raise ValueError(f"adapter {name!r} released more often than held")
        entry.holds -= 1

    def set_pinned(self, name: str, pinned: bool) -> None:
        self._entries[name].pinned = pinned

    def remove(self, name: str) -> None:
        """Free the slot of an adapter no request holds (unload)."""
        entry = self._entries.get(name)
        if entry is None:
            return
        if entry.holds:
            raise ValueError(f"adapter {name!r} is held by {entry.holds} running request(s)")
        del self._entries[name]
        self._free.append(entry.slot)
