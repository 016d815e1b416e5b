"""What the affinity router adds to Ray Serve's cached queue lengths, apart from Ray:
`QueueLengthFeed`, fed the same calls by `router.serve_router.AffinityRequestRouter` (from
Serve's hooks) and by the fleet simulator's router (`sim.serve.Router`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from router.routing import stats_queue_len

IN_TRANSIT_S = 5.0  # a send still unanswered after this is forgotten (see `InTransit`)


class InTransit:
    """Per replica, the times of this router's sends that the replica has not answered yet.

    A replica answers each request it takes with its count of ongoing requests, and Serve sets
    the router's cached queue length to it. That count cannot include this router's requests
    still on their way there, so on its own it reads low, and lowest for the replica slowest to
    take its requests: in a burst, the busiest one, which then draws more (measured through
    HTTP, 2 replicas: 359 against 665 requests). The router adds what it still has in transit.
    Answers come in the order of the sends (one caller's calls to an actor), so each one
    retires the oldest send; a send never answered (a broadcast, a failed call) is forgotten
    after `expiry_s`, so a miscount cannot last.
    """

    def __init__(self, expiry_s: float = IN_TRANSIT_S) -> None:
        self.expiry_s = expiry_s
        self._sent: dict[Any, deque[float]] = {}

    def sent(self, replica: Any, now: float) -> None:
        self._sent.setdefault(replica, deque()).append(now)

    def answered(self, replica: Any, now: float) -> int:
        """One send to `replica` was answered: retire the oldest; the count still in transit."""
        pending = self.pending(replica, now)
        if pending:
            self._sent[replica].popleft()
        return max(0, pending - 1)

    def pending(self, replica: Any, now: float) -> int:
        """Sends to `replica` not answered yet, those past `expiry_s` forgotten."""
        sent = self._sent.get(replica)
        if not sent:
            return 0
        while sent and now - sent[0] > self.expiry_s:
            sent.popleft()
        return len(sent)

    def forget(self, replica: Any) -> None:
        self._sent.pop(replica, None)

    def keep_only(self, replicas: Iterable[Any]) -> None:
        _keep_only(self._sent, set(replicas))


ANSWER_FRESH_S = 1.0  # a cached length backed by an answer this recent outlives a stats push


class QueueLengthFeed:
    """What the affinity router adds to Serve's cached queue lengths, apart from Ray (the Serve
    router and the simulator's feed it the same calls):

    - `answered`: a replica's answer to one of our sends, plus our sends still on their way
      there (`InTransit`);
    - `reported`: a routing-stats push. The cache's length for a replica counts every router's
      requests as of its last answer, and only this router's completions take any off again,
      so once we stop sending there it keeps what the others have finished since: a stale
      offset, different for each replica, that the next burst is balanced against. A changed
      report replaces a length no answer has backed for `answer_fresh_s` (or a missing one,
      as for a replica whose probes miss Serve's deadline) with the engine's running and
      waiting requests, plus ours on the way.
    """

    def __init__(self, answer_fresh_s: float = ANSWER_FRESH_S) -> None:
        self.answer_fresh_s = answer_fresh_s
        self.in_transit = InTransit()
        self._answered_at: dict[Any, float] = {}
        self._last_stats: dict[Any, Any] = {}

    def sent(self, replica: Any, now: float) -> None:
        self.in_transit.sent(replica, now)

    def answered(self, replica: Any, count: int, now: float) -> int:
        """The length to cache for a replica that answered a send with `count`."""
        self._answered_at[replica] = now
        return count + self.in_transit.answered(replica, now)

    def reported(self, replica: Any, stats: Any, cached: int | None, now: float) -> int | None:
        """The length to cache after a routing-stats push (`cached`: the cache's now), or None
        to leave it. Only a report that changed is known to be new: the controller resends
        every replica's last one when any of them changes."""
        count = stats_queue_len(stats)
        if count is None:
            return None
        last = self._last_stats.get(replica)
        self._last_stats[replica] = stats
        if stats == last:
            return None
        answered = self._answered_at.get(replica)
        if cached is not None and answered is not None and now - answered <= self.answer_fresh_s:
            return None
        return count + self.in_transit.pending(replica, now)

    def forget(self, replica: Any) -> None:
        """The replica failed a call: no answer is coming for what we sent."""
        self.in_transit.forget(replica)
        self._answered_at.pop(replica, None)

    def keep_only(self, replicas: Iterable[Any]) -> None:
        keep = set(replicas)
        self.in_transit.keep_only(keep)
        _keep_only(self._answered_at, keep)
        _keep_only(self._last_stats, keep)


def _keep_only(table: dict[Any, Any], keep: set[Any]) -> None:
    """Drop `table`'s entries for replicas not in `keep` (gone from the deployment)."""
    for replica in [r for r in table if r not in keep]:
        del table[replica]
