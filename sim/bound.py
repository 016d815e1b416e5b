"""What no router can beat: the fewest adapter loads a fleet's caches allow for a request stream.

However requests are placed, the adapters in some replica's GPU slots are at most the fleet's
slots together, and a load adds one adapter to them: the fleet's slots act as one cache of that
size at best, so a run's GPU loads are at least the misses of the optimal offline cache
(Belady's MIN: on a miss with the cache full, give up the entry used again latest) over its
requests in arrival order. Disk reads and the adapters the fleet's memory holds likewise.
Arrival order: a replica that served requests out of order could do better only by holding
some back, which no TTFT target leaves room for.

MIN needs the future. The cells draw each request's adapter independently from a fixed
popularity (the independent reference model), and there the best a cache that does not know
the future can do is A0 (Aho, Denning and Ullman, 1971): keep the `capacity - 1` most probable
items for good and the last other one requested in the remaining entry. Its expected misses a
request (`a0_miss_rate`) are the floor for any router that does not know the requests to come.

Beside the floors, the same single cache run online by LRU (`lru_misses`): what a router would
get if it kept the fleet's slots free of copies and each replica's slots were one cache.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

Item = TypeVar("Item", bound=Hashable)


def belady_misses(sequence: Sequence[Hashable], capacity: int) -> int:
    """Misses of Belady's MIN with `capacity` entries over `sequence`, from an empty cache
    (every first use misses)."""
    if capacity < 1:
        raise ValueError(f"a cache needs at least one entry, got {capacity}")
    never = len(sequence)
    next_use = [never] * len(sequence)
    seen: dict[Hashable, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = seen.get(sequence[i], never)
        seen[sequence[i]] = i
    held: dict[Hashable, int] = {}  # entry -> its next use
    latest: list[tuple[int, int, Hashable]] = []  # (-next use, position, entry); stale ones too
    misses = 0
    for i, item in enumerate(sequence):
        if item not in held:
            misses += 1
            while len(held) == capacity:
                neg_next, _, victim = heapq.heappop(latest)
                if held.get(victim) == -neg_next:  # not stale: its next use is still that
                    del held[victim]
        held[item] = next_use[i]
        heapq.heappush(latest, (-next_use[i], i, item))
    return misses


def warm_floor(sequence: Sequence[Hashable], capacity: int) -> int:
    """A floor on the misses of any cache of `capacity` entries over `sequence`, whatever it
    held at the start: MIN's from empty less `capacity` (a cache started empty can fetch a
    warm start's entries at their first use, one miss each, and otherwise do as it did)."""
    return max(0, belady_misses(sequence, capacity) - capacity)


def lru_misses(sequence: Sequence[Hashable], capacity: int, warmup: Sequence[Hashable] = ()) -> int:
    """Misses of an LRU cache of `capacity` entries over `sequence`, after `warmup` (uncounted)."""
    if capacity < 1:
        raise ValueError(f"a cache needs at least one entry, got {capacity}")
    cache: OrderedDict[Hashable, None] = OrderedDict()
    misses = 0
    for counted, part in ((False, warmup), (True, sequence)):
        for item in part:
            if item in cache:
                cache.move_to_end(item)
                continue
            misses += counted
            cache[item] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return misses


def a0_miss_rate(probabilities: Sequence[float], capacity: int) -> float:
    """The expected misses a request of A0 with `capacity` entries, in the long run, when each
    request names item i with probability `probabilities[i]` (they sum to 1), independently.

    A0 keeps the `capacity - 1` most probable items; the last entry holds the last other item
    requested, which is item j with probability p_j / Q, Q being the probability outside the
    kept items. A request for j outside them misses unless j is that one:
    sum over j outside of p_j (1 - p_j / Q) = Q - sum(p_j^2) / Q. Never below 1 - (the
    `capacity` largest probabilities together), the rate of a cache that could hold those
    without ever admitting another."""
    if capacity < 1:
        raise ValueError(f"a cache needs at least one entry, got {capacity}")
    if min(probabilities, default=0.0) < 0 or not math.isclose(sum(probabilities), 1.0):
        raise ValueError("probabilities must be non-negative and sum to 1")
    outside = sorted(probabilities, reverse=True)[capacity - 1 :]
    q = sum(outside)
    return max(0.0, q - sum(p * p for p in outside) / q) if q > 0 else 0.0


def a0_misses(sequence: Sequence[Item], probabilities: Mapping[Item, float], capacity: int) -> int:
    """Misses of A0 with `capacity` entries over `sequence`, started as it runs: holding the
    `capacity` most probable items of `probabilities` (ties broken by the mapping's order)."""
    if capacity < 1:
        raise ValueError(f"a cache needs at least one entry, got {capacity}")
    ranked = sorted(probabilities, key=lambda item: -probabilities[item])
    kept = set(ranked[: capacity - 1])
    last = ranked[capacity - 1] if len(ranked) >= capacity else None  # the entry that moves
    misses = 0
    for item in sequence:
        if item in kept or item == last:
            continue
        misses += 1
        if len(kept) < capacity - 1:
            kept.add(item)  # room to spare: fewer items than entries
        else:
            last = item
    return misses


@dataclass(frozen=True)
class LoadBound:
    """Per 1k measured requests: floors on GPU loads and disk reads for any router
    (`*_floor_per_1k`, MIN) and for any router that does not know the requests to come
    (`online_*_floor_per_1k`, A0's expected misses under the cell's popularity: NaN without
    one), A0 itself on these requests (`a0_*_per_1k`: a draw can favour the popular items more
    or less than expected), and the same single caches run by LRU after the warm-up
    (`lru_*_per_1k`)."""

    gpu_entries: int
    memory_entries: int
    loads_floor_per_1k: float
    disk_reads_floor_per_1k: float
    lru_loads_per_1k: float
    lru_disk_reads_per_1k: float
    online_loads_floor_per_1k: float = math.nan
    online_disk_reads_floor_per_1k: float = math.nan
    a0_loads_per_1k: float = math.nan
    a0_disk_reads_per_1k: float = math.nan


def fleet_bound(
    measured: Sequence[str | None],
    gpu_entries: int,
    memory_entries: int,
    warmup: Sequence[str | None] = (),
    popularity: Mapping[str, float] | None = None,
) -> LoadBound:
    """For the adapters of a run's measured requests in arrival order (None: the base model)
    and of its warm-up: `gpu_entries`, the fleet's GPU slots; `memory_entries`, the adapters its
    replicas' host caches hold together; `popularity`, each adapter's probability a request,
    when requests draw their adapters independently from it (the online floors need it). The
    floors hold whatever the warm-up left."""
    stream = [a for a in measured if a is not None]
    warm = [a for a in warmup if a is not None]
    per_1k = (lambda n: 1000.0 * n / len(measured)) if measured else (lambda n: math.nan)
    # A0's rate is a request's; the base model's requests need no slot.
    online = lambda entries: (
        per_1k(len(stream) * a0_miss_rate(list(popularity.values()), entries))
        if popularity
        else math.nan
    )
    a0 = lambda entries: per_1k(a0_misses(stream, popularity, entries)) if popularity else math.nan
    return LoadBound(
        gpu_entries=gpu_entries,
        memory_entries=memory_entries,
        loads_floor_per_1k=per_1k(warm_floor(stream, gpu_entries)),
        disk_reads_floor_per_1k=per_1k(warm_floor(stream, memory_entries)),
        lru_loads_per_1k=per_1k(lru_misses(stream, gpu_entries, warm)),
        lru_disk_reads_per_1k=per_1k(lru_misses(stream, memory_entries, warm)),
        online_loads_floor_per_1k=online(gpu_entries),
        online_disk_reads_floor_per_1k=online(memory_entries),
        a0_loads_per_1k=a0(gpu_entries),
        a0_disk_reads_per_1k=a0(memory_entries),
    )
