"""Caller leases: which caller owns each request an engine replica runs, and when each caller is
next asked after. Plain Python (no Ray, no torch); the clock is injected.

A streamed request is a call from an ingress replica. When that process dies, nothing tells the
engine: Ray Serve cancels a replica's generator only when the caller cancels its response, and a
dead caller cancels nothing, so its requests would run to `max_tokens`, holding KV blocks and
batch places. So the replica asks after the callers that own its requests: every `ttl_s` at
most (a lease), through Ray's GCS (`EngineDeployment.abort_abandoned`).

A lease is not a deadline. A lapsed lease only means "ask again"; a caller's requests are
aborted only when the answer says the caller is dead (`abandon`). A slow answer, a failed one,
or none at all keeps every request: they cost a dead caller's requests some time, never a live
caller's requests their tokens. The caller sends nothing to stay alive: a renewal sent as a
Serve call would wait behind the requests it protects once the replica is at
`max_ongoing_requests`.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CallerLeases:
    """Leases by caller id, and the requests each caller owns.

    `track` records a request and renews its caller's lease (a new request is proof of life);
    `renew` extends the lease of a caller that owns requests (it was found alive, perhaps after
    its last request ended: then nothing is kept); `release` forgets a request that
    ended, and its caller once it owns none. `lapsed_callers` lists the callers to ask after;
    `abandon` forgets a caller found dead and returns its requests. A caller found dead stays
    so (`is_dead`, the newest `dead_kept`): DEAD is final for an actor id, so a request of its
    that arrives later (sent before it died, queued behind a busy loop) is not to be tracked.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, dead_kept: int = 64) -> None:
        self.clock = clock
        self.dead_kept = dead_kept
        self._dead: dict[str, None] = {}  # callers found dead, oldest first
        self._until: dict[str, float] = {}  # caller -> when to ask after it again
        self._requests: dict[str, set[str]] = {}  # caller -> request ids
        self._owner: dict[str, str] = {}  # request id -> caller

    def renew(self, caller: str, ttl_s: float) -> None:
        if caller not in self._requests:  # it owns nothing (any more): nothing to ask after
            return
        self._until[caller] = max(self._until.get(caller, 0.0), self.clock() + ttl_s)

    def track(self, request_id: str, caller: str, ttl_s: float) -> None:
        self._owner[request_id] = caller
        self._requests.setdefault(caller, set()).add(request_id)
        self.renew(caller, ttl_s)

    def release(self, request_id: str) -> None:
        caller = self._owner.pop(request_id, None)
        if caller is None:
            return
        owned = self._requests.get(caller)
        if owned is not None:
            owned.discard(request_id)
            if not owned:
                del self._requests[caller]
                del self._until[caller]  # nothing to ask after; its next request starts anew

    def lapsed_callers(self) -> list[str]:
        """Callers whose lease ran out, each owning requests: to be asked after. Their
        requests stay theirs whatever the answer takes."""
        now = self.clock()
        return [c for c, until in self._until.items() if until <= now and c in self._requests]

    def abandon(self, caller: str) -> list[str]:
        """Forget `caller`, found dead, and return the requests it owned (to be aborted)."""
        self._dead[caller] = None
        while len(self._dead) > self.dead_kept:
            del self._dead[next(iter(self._dead))]
        self._until.pop(caller, None)
        abandoned = sorted(self._requests.pop(caller, ()))
        for request_id in abandoned:
            del self._owner[request_id]
        return abandoned

    def is_dead(self, caller: str) -> bool:
        """Whether `caller` was found dead (`abandon`)."""
        return caller in self._dead

    def owns(self, caller: str) -> int:
        """How many live requests `caller` owns."""
        return len(self._requests.get(caller, ()))

    def callers(self) -> dict[str, int]:
        """Every caller owning requests, with how many."""
        return {caller: len(owned) for caller, owned in self._requests.items()}

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    @property
    def num_tracked(self) -> int:
        return len(self._owner)
