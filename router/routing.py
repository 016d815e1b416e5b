"""The affinity router's logic apart from Ray: replica views from routing stats, the policy's
tiers, prefetch hints and per-request accounting. Plain Python: `router.serve_router` wraps it
in Ray Serve's `RequestRouter`, and the fleet simulator (`sim/`) drives the same object.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.policy import AffinityPolicy, ReplicaView

logger = logging.getLogger("ray.serve")


class HintTarget(Protocol):
    """Where hints go (`router.hints.HintSender` in Serve, a simulated one in `sim/`)."""

    def send(self, adapter: str, replica_id: str) -> bool: ...


DEFAULT_NUM_SLOTS = 8


def replica_view(
    replica_id: str,
    stats: Mapping[str, Any] | None,
    *,
    queue_len: int | None = None,
    tokens_in_flight: int = 0,
    default_num_slots: int = DEFAULT_NUM_SLOTS,
) -> ReplicaView:
    """What the policy sees of one replica. `stats` is its `routing_stats` (possibly empty,
    partial or from an older version: what is missing reads as "nothing resident, all slots
    free", which is what a replica that has not reported yet most likely is). `queue_len` None
    falls back to the engine's running + waiting counts from `stats`."""
    stats = stats if isinstance(stats, Mapping) else {}
    num_slots = _count(stats.get("num_slots"), default_num_slots)
    free_slots = min(_count(stats.get("free_slots"), num_slots), num_slots)
    if queue_len is None:
        queue_len = _count(stats.get("num_running"), 0) + _count(stats.get("num_waiting"), 0)
    return ReplicaView(
        replica_id=replica_id,
        gpu=_names(stats.get("gpu")),
        loading=_names(stats.get("loading")),
        host=_names(stats.get("host")),
        num_slots=num_slots,
        free_slots=free_slots,
        queue_len=max(0, queue_len),
        tokens_in_flight=max(0, tokens_in_flight),
    )


def reported_stats(replica: Any) -> Any:
    """A replica's `routing_stats`, None before it has reported (Serve raises then)."""
    try:
        return replica.routing_stats
    except Exception:
        return None


def stats_queue_len(stats: Any) -> int | None:
    """The engine's running plus waiting requests in `routing_stats`, None when they are not
    both there."""
    if not isinstance(stats, Mapping):
        return None
    running, waiting = stats.get("num_running"), stats.get("num_waiting")
    if isinstance(running, int) and isinstance(waiting, int) and min(running, waiting) >= 0:
        return running + waiting
    return None


PLACING_S = 30.0  # a request ranked this long ago and not yet routed stops counting as demand


def _names(value: Any) -> frozenset[str]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return frozenset(v for v in value if isinstance(v, str))
    return frozenset()


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value >= 0 else default


@dataclass(frozen=True)
class _Routed:
    adapter: str | None
    replica_id: str
    tokens: int


class AffinityRouting:
    """The router's logic apart from Ray's base class: views, tiers, hints and accounting.

    Replicas are anything with `replica_id.unique_id` and `routing_stats` (`RunningReplica` in
    Serve, fakes in tests). Not thread-safe: Serve calls it from the router's event loop only.
    """

    def __init__(
        self,
        policy: AffinityPolicy,
        *,
        hints: HintTarget | None = None,
        default_num_slots: int = DEFAULT_NUM_SLOTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.hints = hints
        self.default_num_slots = default_num_slots
        self.clock = clock
        self._routed: dict[str, _Routed] = {}  # internal request id -> placement
        self._tokens: dict[str, int] = {}  # replica id -> tokens of our requests in flight
        # Requests ranked and not yet routed, oldest first: request id -> (adapter, when). Serve
        # reports a placement once the replica took the request, after the whole of a burst
        # may have been ranked; until then they count in their adapter's demand (`on_placing`).
        self._placing: OrderedDict[str, tuple[str | None, float]] = OrderedDict()

    def views(
        self,
        replicas: Sequence[Any],
        queue_len: Callable[[Any], int | None] = lambda _: None,
    ) -> list[ReplicaView]:
        views = []
        for replica in replicas:
            rid = replica.replica_id.unique_id
            views.append(
                replica_view(
                    rid,
                    reported_stats(replica),
                    queue_len=queue_len(replica),
                    tokens_in_flight=self._tokens.get(rid, 0),
                    default_num_slots=self.default_num_slots,
                )
            )
        return views

    def rank(
        self,
        adapter: str | None,
        replicas: Sequence[Any],
        queue_len: Callable[[Any], int | None] = lambda _: None,
        request_id: str | None = None,
    ) -> list[list[Any]]:
        """The policy's tiers as lists of `replicas`, best first. Never empty when `replicas`
        is not: a policy answer that names none of them falls back to one tier of all.
        `request_id` (the request's internal id) makes it count in its adapter's demand from
        now until it is routed or finished, ranked again or not."""
        if not replicas:
            return []
        tiers = self._rank(adapter, replicas, queue_len)
        self._placing_started(request_id, adapter)  # after: its own rank counts it as the +1
        return tiers

    def _placing_started(self, request_id: str | None, adapter: str | None) -> None:
        now = self.clock()
        while self._placing:  # one that waited this long is no burst: it stops counting
            oldest, (old_adapter, since) = next(iter(self._placing.items()))
            if now - since <= PLACING_S:
                break
            del self._placing[oldest]
            self.policy.on_placed(old_adapter)
        if request_id is None or request_id in self._placing or request_id in self._routed:
            return
        self._placing[request_id] = (adapter, now)
        self.policy.on_placing(adapter)

    def _placing_ended(self, request_id: str) -> None:
        placing = self._placing.pop(request_id, None)
        if placing is not None:
            self.policy.on_placed(placing[0])

    def _rank(
        self,
        adapter: str | None,
        replicas: Sequence[Any],
        queue_len: Callable[[Any], int | None],
    ) -> list[list[Any]]:
        views = self.views(replicas, queue_len)
        by_id = {view.replica_id: replica for view, replica in zip(views, replicas, strict=True)}
        tiers: list[list[Any]] = []
        seen: set[str] = set()
        for tier in self.policy.rank(adapter, views):
            chosen = [by_id[rid] for rid in tier if rid in by_id and rid not in seen]
            seen.update(replica.replica_id.unique_id for replica in chosen)
            if chosen:
                tiers.append(chosen)
        if not tiers:
            logger.warning("the routing policy ranked none of %d replicas", len(replicas))
            return [list(replicas)]
        if adapter is not None and self.hints is not None:
            self._hint(self.hints, adapter, tiers[0], {view.replica_id: view for view in views})
        return tiers

    def _hint(
        self, hints: HintTarget, adapter: str, tier: list[Any], views: dict[str, ReplicaView]
    ) -> None:
        # Serve takes the shortest queue in the tier: hint that one.
        target = min(tier, key=lambda r: views[r.replica_id.unique_id].queue_len)
        view = views[target.replica_id.unique_id]
        # Only into a free slot: a hinted load that evicts an idle adapter often evicts the one
        # the next admitted request needs (measured: more loads and misses, not fewer).
        if adapter in view.gpu or adapter in view.loading or view.free_slots == 0:
            return
        try:
            hints.send(adapter, view.replica_id)
        except Exception:  # hints are advice: never fail routing over one
            logger.debug("sending a prefetch hint failed", exc_info=True)

    def routed(self, request_id: str, adapter: str | None, replica_id: str, tokens: int) -> None:
        self._placing_ended(request_id)
        if request_id in self._routed:  # routed again after a rejection: the old one is over
            self.finished(request_id, self._routed[request_id].replica_id)
        self._routed[request_id] = _Routed(adapter, replica_id, tokens)
        self._tokens[replica_id] = self._tokens.get(replica_id, 0) + tokens
        self.policy.on_routed(adapter, replica_id)

    def finished(self, request_id: str, replica_id: str) -> None:
        """Idempotent; ignores completions of attempts that were never routed (rejections)."""
        self._placing_ended(request_id)
        routed = self._routed.get(request_id)
        if routed is None or routed.replica_id != replica_id:
            return
        del self._routed[request_id]
        left = self._tokens.get(replica_id, 0) - routed.tokens
        if left > 0:
            self._tokens[replica_id] = left
        else:
            self._tokens.pop(replica_id, None)
        self.policy.on_finished(routed.adapter, replica_id)

    def tokens_in_flight(self, replica_id: str) -> int:
        return self._tokens.get(replica_id, 0)
