"""Routing policy: which replica should serve a request for a given adapter. Plain Python: no
Ray, no torch. `router.serve_router` applies it inside Ray Serve; the fleet simulator (`sim/`)
drives the same code on a virtual clock.

A policy answers `rank(adapter, replicas)` with the replica ids in ranked tiers, best tier first,
every id exactly once. The caller sends to the replica with the shortest queue among those with
room in the first tier that has any (Ray Serve's rule), so a tier of one replica is an exact
order and a tier of several leaves the choice among them to queue length.

`AffinityPolicy` places an adapter where it already is (GPU slot, loading, host memory), breaks
ties by rendezvous hashing so every router instance picks the same home for a cold adapter,
widens an adapter's home to more replicas while its demand exceeds one replica's share (and
narrows it back as the demand falls), overflows an overloaded home onto replicas that already
hold the adapter, sends a cold adapter to the less loaded of its two hash choices when its
first is clearly busier, and never ranks a replica loaded beyond `imbalance_bound` × the fleet
mean (or `load_slack` above it) ahead of one that is not (consistent hashing with bounded loads,
applied to the adapter's placement order). Where locality cannot save a load, because few
recent requests needed one (slots not contended), every replica holding the adapter shares its
home tier, so the choice among them is the shortest queue, as in Ray's default router.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


@dataclass(frozen=True)
class ReplicaView:
    """What a router knows about one replica at decision time."""

    replica_id: str
    gpu: frozenset[str] = frozenset()  # adapters resident in GPU slots
    loading: frozenset[str] = frozenset()  # adapters being loaded to GPU
    host: frozenset[str] = frozenset()  # adapters in the pinned host cache
    num_slots: int = 8  # GPU adapter slots (max_loras_per_batch)
    free_slots: int = 8  # slots holding nothing (no eviction needed)
    queue_len: int = 0  # requests waiting + running there (router's best estimate)
    tokens_in_flight: int = 0  # optional load signal (prompt+max tokens outstanding)


class Tier(IntEnum):
    """Where an adapter is on one replica, best first: what serving it there costs."""

    GPU = 0  # resident: no load
    LOADING = 1  # a load is already under way
    HOST = 2  # host→GPU copy into a free slot (about 1.5 ms for a rank-16 Llama-3-8B adapter)
    FREE_SLOT = 3  # disk read + copy, no eviction
    # Host copy, and another adapter loses its slot. Below a free slot elsewhere: an eviction is
    # paid again when the evicted adapter comes back, and a replica whose host memory holds
    # everything would otherwise draw every cold adapter while the others' slots stay empty
    # (seen on two GPUs: all requests on one replica, 1.9x the loads of power of two choices).
    HOST_EVICT = 4
    EVICT = 5  # disk read + copy, and another adapter loses its slot


class RoutingPolicy(Protocol):
    def rank(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> list[list[str]]:
        """Replica ids in ranked tiers, best tier first; every replica id appears exactly once.
        The caller sends to the first replica with room in the first tier that has one
        (Ray Serve takes the shortest queue within a tier)."""
        ...

    def on_routed(self, adapter: str | None, replica_id: str) -> None:
        """The caller sent a request for `adapter` to `replica_id`."""
        ...

    def on_finished(self, adapter: str | None, replica_id: str) -> None:
        """A request previously reported to `on_routed` finished (or failed)."""
        ...


# ---------------------------------------------------------------------------------------------
# Stable hashing. Python's hash() is salted per process, so two router instances would disagree;
# a keyed digest from hashlib is the same everywhere.

_MASK64 = (1 << 64) - 1
_RESCALE_AT = 2.0**40  # AffinityPolicy's share weights are rescaled before they grow past this


def stable_hash(key: str) -> int:
    """64-bit hash of `key`, identical in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    # splitmix64 finaliser: spreads the bits of a combined key over the whole word, so a
    # rendezvous weight built from two digests behaves like a digest of the pair.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Rendezvous:
    """Highest-random-weight order of replicas for a key, cached per key.

    weight(key, replica) = mix(h(key) ^ rotl(h(replica))): one digest per key and one per
    replica, then integer arithmetic per pair, so ordering 256 replicas costs no hashing.
    The order depends only on the set of replica ids, never on the order they are given in.
    """

    def __init__(self, cache_size: int = 4096) -> None:
        self._replica_hash: dict[str, int] = {}
        self._orders: OrderedDict[tuple[str, frozenset[str]], list[str]] = OrderedDict()
        self._cache_size = cache_size

    def _rhash(self, replica_id: str) -> int:
        h = self._replica_hash.get(replica_id)
        if h is None:
            h = stable_hash("replica\0" + replica_id)
            h = ((h << 17) | (h >> 47)) & _MASK64
            self._replica_hash[replica_id] = h
        return h

    def order(self, key: str, replica_ids: frozenset[str]) -> list[str]:
        """`replica_ids` from highest weight to lowest (ties, vanishingly rare, by id)."""
        cache_key = (key, replica_ids)
        cached = self._orders.get(cache_key)
        if cached is not None:
            self._orders.move_to_end(cache_key)
            return cached
        kh = stable_hash("adapter\0" + key)
        order = sorted(replica_ids, key=lambda r: (-_mix(kh ^ self._rhash(r)), r))
        self._orders[cache_key] = order
        if len(self._orders) > self._cache_size:
            self._orders.popitem(last=False)
        return order


# ---------------------------------------------------------------------------------------------


class AffinityPolicy:
    """Adapter-affinity routing with bounded load.

    For an adapter `a`:
    1. Each replica gets a `Tier` from the view (GPU, loading, host, and whether a slot is
       free there), overridden by the policy's own record: a replica holding outstanding
       requests for `a` that this policy sent is at least LOADING there, however stale the
       view. A replica that would have to evict ranks below one with a free slot, even when
       only the first has `a` in host memory.
    2. The placement order is (tier, rendezvous rank of the replica for `a`): where `a` already
       is comes first, and among equals every router instance agrees.
    3. A replica is overloaded when load + 1 > max(imbalance_bound × m, m + load_slack), m being
       the mean load counting the request being placed; overloaded replicas go last, in
       placement order among themselves.
    4. `a`'s home is the first k non-overloaded replicas of the placement order: one tier,
       balanced by queue length. k is the larger of ceil(outstanding(a) / spread_threshold),
       which follows bursts (outstanding counts the requests being placed too, and both are
       this policy's own), and ceil(n × share(a) / spread_share), share(a) being `a`'s share
       of the requests this policy routed recently: an adapter carrying more than
       `spread_share` of one replica's fair share of the traffic is spread before its home
       piles up, even at light load where outstanding requests are too few to show it. As
       demand falls k shrinks and replicas past the home stop receiving `a`, so its slots there
       age out.
    5. Copies: other replicas that hold `a` (GPU or loading) come next in the placement
       order, so an overloaded home overflows onto a copy made by an earlier burst without a
       load. They do not share the home's tier: a copy taking every request the home's queue
       length lost would stay resident for good, and `a` would hold a slot on every replica it
       ever spread to after its demand fell back (seen in the fleet simulator: an adapter that
       had needed two replicas went on using both at a fifth of that demand). That matters
       only while slots are contended (`contended`): otherwise a copy costs no other adapter
       its slot, so every non-overloaded holder joins the home tier (Serve then takes the
       shortest queue among them, Ray's default rule) and k uses `uncontended_spread_share`.
    6. Cold: when no non-overloaded replica holds `a` (the best tier is HOST or worse) and
       k = 1, the home is the better of two hash choices, the first two non-overloaded replicas
       of that best tier: the first, unless its load exceeds the second's by more than
       (imbalance_bound - 1) × the mean load. The load happens either way; this puts it where
       it evens out the fleet, while every router instance still picks from the same two
       (all least-loaded-anywhere would herd routers with stale views onto one replica, and
       split a burst of one adapter's requests over several replicas, each loading it).
    7. The remaining non-overloaded replicas follow one per tier, in placement order: overflow
       goes to the next replica that has `a`, else the next by hash, never to a random one.

    `adapter=None` (the base model) needs no slot: replicas are ranked by load alone.

    Deterministic: given the same views and the same history of on_routed/on_finished calls,
    two instances return the same ranking.
    """

    def __init__(
        self,
        *,
        imbalance_bound: float = 1.25,
        spread_threshold: float | None = None,
        load_slack: float = 8.0,
        tokens_per_request: float | None = None,
        min_spread_threshold: float = 6.0,
        spread_share: float | None = 0.6,
        share_half_life: int = 1024,
        share_prior: int = 32,
        contended_miss_share: float | None = 0.1,
        miss_window: int = 64,
        uncontended_spread_share: float | None = 0.4,
    ) -> None:
        """
        imbalance_bound: a replica whose load exceeds this multiple of the fleet mean (and the
            mean plus `load_slack`) is demoted behind every replica that does not; also sets
            how much busier a cold adapter's first hash choice may be than its second.
        spread_threshold: outstanding requests of one adapter per replica of its home; None
            adapts it to this policy's own adapter requests in flight per replica (at least
            `min_spread_threshold`), so an adapter gets one replica per replica's worth of
            demand. Its own, not the fleet's mean load: each ingress routes only part of the
            traffic, and `outstanding(a)` is that part (4 ingresses and 2 replicas: a router's
            256 requests of one adapter, against the fleet's mean of 512, never spread it).
        load_slack: additive room, in requests, before a replica counts as overloaded; it stops
            mattering once the mean load exceeds load_slack / (imbalance_bound - 1) (32 requests
            with the defaults). At light load a few more requests on one replica cost far less
            than the adapter loads that moving them causes: each overflow puts the adapter on a
            replica that must load it (simulated, 2 replicas and 64 adapters at 10-50% load:
            2 made about 3x the loads of 8).
        tokens_per_request: when set, load = max(queue_len, tokens_in_flight / this), which
            weighs long requests more than short ones; else load = queue_len.
        min_spread_threshold: the adaptive threshold's floor. At light load a burst of a few
            requests for one adapter is no reason to put it on a second replica: the copy
            takes a slot there for as long as it stays in use.
        spread_share: an adapter gets one home replica per this fraction of a replica's fair
            share (1/n) of the recent traffic; None spreads by outstanding requests alone.
            Below 1 so that a home replica keeps room for other adapters: with 2 replicas an
            adapter taking more than 30% of the requests gets both.
        share_half_life: routed requests after which a past request counts half in share(a).
        share_prior: share(a) divides by at least this many requests (at most the weight of a
            whole window), so the first few requests a router sees do not make their adapters
            look hot. Small, because each ingress replica routes with its own policy and sees
            only its part of the traffic (2 ingresses per engine replica on GPUs): with 256,
            routers that had seen 120 requests each never spread an adapter taking half of
            them (simulated, hot-2x of docs/perf/routing_sim.md; 32 spreads it in 3 s).
        contended_miss_share: slots count as contended while more than this share of the
            requests routed lately went to a replica without their adapter on GPU (each such
            request costs a load). Uncontended, every replica holding the adapter joins its
            home tier, so Serve takes the shortest queue among them, as Ray's default router
            does; contended, copies stay out of it so the adapter narrows back and frees their
            slots. None: always contended.
        miss_window: routed requests over which the miss share is averaged (exponentially).
        uncontended_spread_share: `spread_share` while slots are not contended: a copy then
            costs one load and stays, so an adapter is spread at a smaller share of the
            traffic, for balance. None: `spread_share` always.
        """
        if imbalance_bound < 1.0:
            raise ValueError("imbalance_bound below 1 would demote every replica")
        if spread_threshold is not None and spread_threshold <= 0:
            raise ValueError("spread_threshold must be positive")
        if load_slack < 0:
            raise ValueError("load_slack cannot be negative")
        if spread_share is not None and spread_share <= 0:
            raise ValueError("spread_share must be positive")
        if share_half_life < 1 or share_prior < 1:
            raise ValueError("share_half_life and share_prior must be at least 1")
        if contended_miss_share is not None and not 0 <= contended_miss_share <= 1:
            raise ValueError("contended_miss_share is a share: between 0 and 1")
        if miss_window < 1:
            raise ValueError("miss_window must be at least 1")
        self.imbalance_bound = imbalance_bound
        self.spread_threshold = spread_threshold
        self.load_slack = load_slack
        self.tokens_per_request = tokens_per_request
        self.min_spread_threshold = min_spread_threshold
        self.spread_share = spread_share
        self._hrw = Rendezvous()
        # Requests this policy sent and has not seen finish: per (adapter, replica) and per
        # adapter. The replica's stats arrive every period; this fills the gap.
        self._outstanding: dict[tuple[str, str], int] = defaultdict(int)
        self._demand: dict[str, int] = defaultdict(int)
        self._in_flight = 0  # the sum of _demand: this policy's adapter requests in flight
        # Requests ranked and not yet routed (Serve reports a placement only once the replica
        # took it): in a burst, most of this policy's requests for an adapter are here.
        self._placing: dict[str, int] = defaultdict(int)
        self._placing_total = 0
        # Routed requests per adapter, exponentially decayed per routed request. Rather than
        # decaying every entry, each request adds a weight that grows by `_growth`; entries are
        # rescaled (and the faded ones dropped) before the weight gets large.
        self._growth = 2.0 ** (1.0 / share_half_life)
        self._weight = 1.0
        # The prior never exceeds what a full window adds up to: 1 + 1/g + 1/g² + ...
        self._prior = min(float(share_prior), self._growth / (self._growth - 1.0))
        self._recent: dict[str, float] = defaultdict(float)
        self._recent_total = 0.0
        self.contended_miss_share = contended_miss_share
        self.uncontended_spread_share = uncontended_spread_share
        self._miss_decay = 1.0 - 1.0 / miss_window
        # Share of recent requests that found their adapter off the GPU where they were sent.
        # It starts at 0, as a fresh fleet's slots are free; the first misses raise it within
        # a few requests. (Starting at 1, routers that each see a part of the traffic stayed
        # contended through a whole 300-request run of the easy cell: imbalance 1.54 against
        # 1.28, docs/perf/routing_sim.md.)
        self._miss_share = 0.0
        self._last_tiers: tuple[str, dict[str, Tier]] | None = None  # from the latest rank()

    # -- own record ---------------------------------------------------------------------------

    def on_routed(self, adapter: str | None, replica_id: str) -> None:
        if adapter is None:
            return
        if self._last_tiers is not None and self._last_tiers[0] == adapter:
            tier = self._last_tiers[1].get(replica_id)
            if tier is not None:
                miss = 1.0 if tier >= Tier.HOST else 0.0
                self._miss_share += (1.0 - self._miss_decay) * (miss - self._miss_share)
        self._outstanding[adapter, replica_id] += 1
        self._demand[adapter] += 1
        self._in_flight += 1
        self._weight *= self._growth
        self._recent[adapter] += self._weight
        self._recent_total += self._weight
        if self._weight > _RESCALE_AT:
            self._rescale()

    def _rescale(self) -> None:
        # Back to a weight of 1: entries become counts of recent requests, and those that have
        # faded below a hundredth of one are forgotten.
        w = self._weight
        recent = {a: c / w for a, c in self._recent.items() if c / w >= 0.01}
        self._recent = defaultdict(float, recent)
        self._recent_total /= w
        self._weight = 1.0

    def on_finished(self, adapter: str | None, replica_id: str) -> None:
        if adapter is None:
            return
        key = (adapter, replica_id)
        if self._outstanding.get(key, 0) <= 0:
            return  # unknown to us (routed before a restart): nothing to undo
        self._outstanding[key] -= 1
        if self._outstanding[key] == 0:
            del self._outstanding[key]
        self._demand[adapter] -= 1
        self._in_flight -= 1
        if self._demand[adapter] == 0:
            del self._demand[adapter]

    @property
    def miss_share(self) -> float:
        """Share of the requests routed lately (over about `miss_window`) that were sent where
        their adapter was not on GPU nor loading, as the views showed at the time."""
        return self._miss_share

    @property
    def contended(self) -> bool:
        """Slots are contended: enough recent requests needed a load (see __init__)."""
        if self.contended_miss_share is None:
            return True
        return self._miss_share > self.contended_miss_share

    def demand(self, adapter: str) -> int:
        """Outstanding requests for `adapter` that this policy routed."""
        return self._demand.get(adapter, 0)

    def on_placing(self, adapter: str | None) -> None:
        """A request for `adapter` was ranked and is on its way to a replica: it counts in the
        adapter's demand until `on_placed` (routed, or ended without a replica)."""
        if adapter is None:
            return
        self._placing[adapter] += 1
        self._placing_total += 1

    def on_placed(self, adapter: str | None) -> None:
        if adapter is None or self._placing.get(adapter, 0) <= 0:
            return
        self._placing[adapter] -= 1
        self._placing_total -= 1
        if self._placing[adapter] == 0:
            del self._placing[adapter]

    def placing(self, adapter: str) -> int:
        return self._placing.get(adapter, 0)

    def share(self, adapter: str) -> float:
        """`adapter`'s share of the requests this policy routed recently (decayed with
        `share_half_life`, over at least `share_prior` requests or the whole window if that is
        shorter): between 0 and 1."""
        total = max(self._recent_total, self._prior * self._weight)
        return self._recent.get(adapter, 0.0) / total

    # -- ranking ------------------------------------------------------------------------------

    def _load(self, view: ReplicaView) -> float:
        if self.tokens_per_request:
            return max(float(view.queue_len), view.tokens_in_flight / self.tokens_per_request)
        return float(view.queue_len)

    def tier(self, adapter: str, view: ReplicaView) -> Tier:
        """Where `adapter` is on this replica, as far as this policy knows."""
        if adapter in view.gpu:
            return Tier.GPU
        if adapter in view.loading or (adapter, view.replica_id) in self._outstanding:
            return Tier.LOADING
        if view.free_slots > 0:
            return Tier.HOST if adapter in view.host else Tier.FREE_SLOT
        return Tier.HOST_EVICT if adapter in view.host else Tier.EVICT

    def num_home(self, adapter: str, n: int) -> int:
        """How many replicas `adapter`'s demand (counting the request being routed) and its
        recent share of the traffic need."""
        threshold = self.spread_threshold
        if threshold is None:
            # One replica per replica's worth of this policy's own requests in flight: its
            # demand for `a` is its own part of the fleet's (each ingress routes some of the
            # traffic), so it is measured against its own part of the load, not the fleet's.
            in_flight = self._in_flight + self._placing_total
            threshold = max(self.min_spread_threshold, in_flight / n)
        k = math.ceil((self.demand(adapter) + self.placing(adapter) + 1) / threshold)
        spread_share = self.spread_share
        if self.uncontended_spread_share is not None and not self.contended:
            spread_share = self.uncontended_spread_share
        if spread_share is not None:
            k = max(k, math.ceil(n * self.share(adapter) / spread_share))
        return max(1, min(n, k))

    def rank(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> list[list[str]]:
        n = len(replicas)
        if n == 0:
            return []
        by_id = {v.replica_id: v for v in replicas}
        if len(by_id) != n:
            raise ValueError("replica ids must be unique")
        loads = {rid: self._load(v) for rid, v in by_id.items()}
        total = sum(loads.values())
        mean = total / n
        # The request being placed counts, so an empty fleet never demotes anyone; the additive
        # slack matters only while loads are a few requests, where ratios mean nothing.
        mean_after = (total + 1) / n
        bound = max(self.imbalance_bound * mean_after, mean_after + self.load_slack)
        hrw = self._hrw.order("" if adapter is None else adapter, frozenset(by_id))

        if adapter is None:
            # Base model: no slot to find. Least loaded first; hash order breaks ties stably.
            pos = {rid: i for i, rid in enumerate(hrw)}
            return [[rid] for rid in sorted(hrw, key=lambda r: (loads[r], pos[r]))]

        # Placement order: bucket by tier, each bucket already in rendezvous order.
        tier = {rid: self.tier(adapter, by_id[rid]) for rid in hrw}
        self._last_tiers = (adapter, tier)
        buckets: list[list[str]] = [[] for _ in Tier]
        for rid in hrw:
            buckets[tier[rid]].append(rid)
        placement = [rid for bucket in buckets for rid in bucket]

        fit = [rid for rid in placement if loads[rid] + 1 <= bound]
        over = [rid for rid in placement if loads[rid] + 1 > bound]
        if not fit:
            return [[rid] for rid in over]
        k = self.num_home(adapter, n)
        if k == 1 and tier[fit[0]] >= Tier.HOST:
            home = [self._cold_home(fit, tier, loads, mean)]
        else:
            home = fit[:k]
        if tier[fit[0]] <= Tier.LOADING and not self.contended:
            # Locality cannot save a load here: every holder is as good as the home.
            home += [rid for rid in fit[k:] if tier[rid] <= Tier.LOADING]
        in_home = set(home)
        tiers = [home]
        tiers += [[rid] for rid in fit if rid not in in_home]
        tiers += [[rid] for rid in over]
        return tiers

    def _cold_home(
        self, fit: list[str], tier: dict[str, Tier], loads: dict[str, float], mean: float
    ) -> str:
        """The home of an adapter no non-overloaded replica holds: the first of the best tier's
        first two replicas in placement order, unless it is busier than the second by more
        than (imbalance_bound - 1) × `mean` (see the class docstring, step 6)."""
        first = fit[0]
        second = next((rid for rid in fit[1:] if tier[rid] == tier[first]), None)
        if second is None:
            return first
        if loads[first] > loads[second] + (self.imbalance_bound - 1) * mean:
            return second
        return first
