"""Prefetch order: which adapters to bring into GPU slots next, and which to give up for them.
Plain Python: no torch.

The queue holds (adapter, due): when the adapter is expected to be needed, from the replica's
waiting queue (due = the request's arrival) and from hints sent from outside the engine (the
router: due = when the request is expected to arrive). `plan` walks it soonest first and
takes a free slot, or evicts the resident adapter whose own next need is latest (never used again
first, least recently used among those) -- and only when that need is strictly later than the
one being served, so a prefetch never evicts an adapter needed sooner than the one it loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

HINT_TTL_S = 30.0  # a hint whose request has not shown up this long after it was due is dropped


@dataclass(frozen=True)
class Load:
    adapter: str
    evict: str | None  # the resident adapter whose slot it takes, if any


@dataclass(frozen=True)
class SlotView:
    """What the planner needs to know about the slot pool right now."""

    free: int  # slots holding nothing
    resident: tuple[str, ...]  # on the GPU or loading, least recently used first
    evictable: frozenset[str]  # resident, not held by a running request, not pinned


class PrefetchQueue:
    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError("the prefetch queue needs room for at least one entry")
        self.capacity = capacity
        self._due: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._due

    def hint(self, adapter: str, due: float) -> None:
        """Expect `adapter` at time `due`; keeps the soonest of several hints. When full, the
        latest-due entry gives way (or the new one is dropped if it is the latest)."""
        if adapter in self._due:
            self._due[adapter] = min(self._due[adapter], due)
            return
        if len(self._due) >= self.capacity:
            latest = max(self._due, key=self._due.__getitem__)
            if self._due[latest] <= due:
                return
            del self._due[latest]
        self._due[adapter] = due

    def due(self, adapter: str) -> float:
        return self._due.get(adapter, math.inf)

    def discard(self, adapter: str) -> None:
        self._due.pop(adapter, None)

    def expire(self, before: float) -> None:
        """Forget hints that were due before `before` (their requests never came)."""
        for adapter in [a for a, due in self._due.items() if due < before]:
            del self._due[adapter]

    def ordered(self) -> list[tuple[str, float]]:
        return sorted(self._due.items(), key=lambda item: item[1])

    def plan(
        self, slots: SlotView, max_loads: int, loadable: Callable[[str], bool] = lambda a: True
    ) -> list[Load]:
        """Up to `max_loads` loads to start now, soonest need first. Needs that are not
        `loadable` yet (weights still on disk) are passed over but still protect their slots
        from eviction by later needs."""
        loads: list[Load] = []
        free = slots.free
        resident = set(slots.resident)
        # Eviction candidates, best victim first: latest next need, then least recently used.
        order = {name: i for i, name in enumerate(slots.resident)}
        victims = sorted(slots.evictable, key=lambda a: (-self.due(a), order[a]))
        for adapter, due in self.ordered():
            if len(loads) >= max_loads:
                break
            if adapter in resident or not loadable(adapter):
                continue
            if free > 0:
                free -= 1
                loads.append(Load(adapter, None))
                continue
            if not victims or self.due(victims[0]) <= due:
                break  # every candidate is needed no later than this one: stop here
            victim = victims.pop(0)
            loads.append(Load(adapter, victim))
        return loads


class _Slots(Protocol):
    num_slots: int

    @property
    def num_free(self) -> int: ...

    @property
    def resident(self) -> Any: ...

    def evictable(self) -> Iterable[str]: ...

    def remove(self, adapter: str) -> Any: ...


def prefetch_round(
    queue: PrefetchQueue,
    slots: _Slots,
    host: Any,
    budget: Any,
    waiting: Iterable[tuple[str, float]],
    now: float,
    *,
    known: Callable[[str], bool],
    start_read: Callable[[str], bool],
    queued_bytes: Callable[[], float],
    load: Callable[[str, Any], None],
) -> int:
    """One prefetch round, the adapter manager's and the fleet simulator's alike: drop hints
    overdue by HINT_TTL_S, queue the waiting requests' needs, start disk reads for the soonest
    needs not `known` (in a slot or in `host` memory, or not to be read) until `start_read`
    finds no turn free, then start the GPU loads of host entries that `budget` (a CopyBudget)
    lets queue behind `queued_bytes()`, evicting as `plan` says. `load(adapter, entry)` starts
    one load of the entry taken from `host`. Returns how many loads it started."""
    queue.expire(before=now - HINT_TTL_S)
    for adapter, due in waiting:
        queue.hint(adapter, due)
    for adapter, _ in queue.ordered()[: host.capacity]:
        if not known(adapter) and not start_read(adapter):
            break  # no turn free: the later needs wait behind this one
    view = SlotView(
        free=slots.num_free,
        resident=tuple(slots.resident),
        evictable=frozenset(slots.evictable()),
    )
    started = 0
    for planned in queue.plan(view, slots.num_slots, loadable=host.__contains__):
        if not budget.may_queue(queued_bytes(), host.peek(planned.adapter).nbytes):
            break  # the load stream is full for now; a need seen later must not queue behind
        if planned.evict is not None:
            slots.remove(planned.evict)
        load(planned.adapter, host.get(planned.adapter))
        started += 1
    return started
