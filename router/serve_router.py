"""The adapter-affinity request router: Ray Serve's `RequestRouter` around `AffinityPolicy`.

Attached to the engine deployment (`request_router_config.request_router_class =
"router.serve_router:AffinityRequestRouter"`); one instance runs inside every caller's handle
(each ingress replica, each proxy). Per request, `choose_replicas`:

1. builds a `ReplicaView` per candidate from what the replica reports in `routing_stats`
   (`EngineDeployment.record_routing_stats`: adapters on GPU, loading, in host memory, slots,
   polled by the controller every `request_routing_stats_period_s`), the router's queue-length
   cache, and this router's own count of tokens it has in flight on each replica;
2. asks the policy for ranked tiers of replica ids (the request's adapter is its multiplexed
   model id, "" for the base model) and maps them back to `RunningReplica`s; Serve then takes
   the shortest queue with room in the first tier that has one;
3. posts a prefetch hint (`router.hints`) to the replica Serve is about to pick, when the
   adapter is not already on its GPU and that replica has a free slot for it, so the load
   starts even while the request waits in this router for room on that replica.

`on_request_routed` / `on_request_completed` feed the policy's `on_routed` / `on_finished`, so
it knows its recent placements before the next stats poll shows them.

No `FIFOMixin`: it hands a replica found for one request to the oldest pending request (or one
for the same adapter), while affinity placement is per request; the base router's exact match
keeps each placement with the request it was chosen for. No `LocalityMixin`: an adapter load
on a GPU costs far more than a hop to another node.

`request_router_kwargs`: `prefetch_hints` (bool, default true), `hint_interval_s` (0.5),
`num_slots` (GPU slots of a replica that has not reported yet, default 8); every other key goes
to `AffinityPolicy` (e.g. `imbalance_bound`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.hints import HINT_INTERVAL_S, HintSender, board_name, lookup_board
from router.policy import AffinityPolicy, ReplicaView

logger = logging.getLogger("ray.serve")

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


def _names(value: Any) -> frozenset[str]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return frozenset(v for v in value if isinstance(v, str))
    return frozenset()


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value >= 0 else default


def request_tokens(pending_request: PendingRequest | None) -> int:
    """Prompt plus output budget of a `generate` call (0 for other calls): the work a request
    brings to its replica."""
    if pending_request is None or not pending_request.args:
        return 0
    request = pending_request.args[0]
    prompt = getattr(request, "prompt_token_ids", None)
    sampling = getattr(request, "sampling", None)
    if prompt is None:
        return 0
    return len(prompt) + int(getattr(sampling, "max_tokens", 0) or 0)


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
        hints: HintSender | None = None,
        default_num_slots: int = DEFAULT_NUM_SLOTS,
    ) -> None:
        self.policy = policy
        self.hints = hints
        self.default_num_slots = default_num_slots
        self._routed: dict[str, _Routed] = {}  # internal request id -> placement
        self._tokens: dict[str, int] = {}  # replica id -> tokens of our requests in flight

    def views(
        self,
        replicas: Sequence[Any],
        queue_len: Callable[[Any], int | None] = lambda _: None,
    ) -> list[ReplicaView]:
        views = []
        for replica in replicas:
            rid = replica.replica_id.unique_id
            try:
                stats = replica.routing_stats
            except Exception:  # a replica that has not reported yet
                stats = None
            views.append(
                replica_view(
                    rid,
                    stats,
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
    ) -> list[list[Any]]:
        """The policy's tiers as lists of `replicas`, best first. Never empty when `replicas`
        is not: a policy answer that names none of them falls back to one tier of all."""
        if not replicas:
            return []
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
            self._hint(adapter, tiers[0], {view.replica_id: view for view in views})
        return tiers

    def _hint(self, adapter: str, tier: list[Any], views: dict[str, ReplicaView]) -> None:
        # Serve takes the shortest queue in the tier: hint that one.
        target = min(tier, key=lambda r: views[r.replica_id.unique_id].queue_len)
        view = views[target.replica_id.unique_id]
        # Only into a free slot: a hinted load that evicts an idle adapter often evicts the one
        # the next admitted request needs (measured: more loads and misses, not fewer).
        if adapter in view.gpu or adapter in view.loading or view.free_slots == 0:
            return
        try:
            self.hints.send(adapter, view.replica_id)
        except Exception:  # hints are advice: never fail routing over one
            logger.debug("sending a prefetch hint failed", exc_info=True)

    def routed(self, request_id: str, adapter: str | None, replica_id: str, tokens: int) -> None:
        if request_id in self._routed:  # routed again after a rejection: the old one is over
            self.finished(request_id, self._routed[request_id].replica_id)
        self._routed[request_id] = _Routed(adapter, replica_id, tokens)
        self._tokens[replica_id] = self._tokens.get(replica_id, 0) + tokens
        self.policy.on_routed(adapter, replica_id)

    def finished(self, request_id: str, replica_id: str) -> None:
        """Idempotent; ignores completions of attempts that were never routed (rejections)."""
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


class AffinityRequestRouter(RequestRouter):
    """Serve's hooks, delegating to `AffinityRouting`. See the module docstring."""

    def initialize_state(
        self,
        prefetch_hints: bool = True,
        hint_interval_s: float = HINT_INTERVAL_S,
        num_slots: int = DEFAULT_NUM_SLOTS,
        **policy_kwargs: Any,
    ) -> None:
        hints = None
        if prefetch_hints:
            name = board_name(self._deployment_id.app_name, self._deployment_id.name)
            hints = HintSender(lambda: lookup_board(name), interval_s=hint_interval_s)
        self.routing = AffinityRouting(
            AffinityPolicy(**policy_kwargs), hints=hints, default_num_slots=num_slots
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        adapter = None
        if pending_request is not None:
            adapter = pending_request.metadata.multiplexed_model_id or None
            # Back off between rounds when no tier had room (Serve retries at once otherwise).
            pending_request.routing_context.should_backoff = True
        return self.routing.rank(adapter, candidate_replicas, self._cached_queue_len)

    def _cached_queue_len(self, replica: RunningReplica) -> int | None:
        return self._replica_queue_len_cache.get(replica.replica_id)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        metadata = pending_request.metadata
        self.routing.routed(
            metadata.internal_request_id,
            metadata.multiplexed_model_id or None,
            replica_id.unique_id,
            request_tokens(pending_request),
        )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.routing.finished(internal_request_id, replica_id.unique_id)
