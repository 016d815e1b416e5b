"""Caller leases: which caller owns each request an engine replica runs, and whether that caller
is still there. Plain Python (no Ray, no torch); the clock is injected.

A streamed request is a call from an ingress replica. When that process dies, nothing tells the
engine: Ray Serve cancels a replica's generator only when the caller cancels its response, and a
dead caller cancels nothing, so its requests would run to `max_tokens`, holding KV blocks and
batch places. So each caller holds a lease on the replica: every request it sends renews it.
When a lease lapses the replica asks whether the caller is alive (Ray's GCS, see
`EngineDeployment.abort_abandoned`) and renews it if so; otherwise every request of that caller
is abandoned and the replica aborts them. The caller sends nothing to stay alive: a renewal sent
as a Serve call would wait behind the requests it protects once the replica is at
`max_ongoing_requests`, and lapse.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CallerLeases:
    """Leases by caller id, and the requests each caller owns.

    `track` records a request and renews its caller's lease (a new request is proof of life);
    `renew` extends a caller's lease; `release` forgets a request that ended. `expired()` returns
    the requests whose caller's lease has run out and forgets them and that caller; a caller that
    renews later starts a new lease.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[str, float] = {}  # caller -> when its lease runs out
        self._requests: dict[str, set[str]] = {}  # caller -> request ids
        self._owner: dict[str, str] = {}  # request id -> caller

    def renew(self, caller: str, ttl_s: float) -> None:
        self._until[caller] = max(self._until.get(caller, 0.0), self.clock() + ttl_s)

    def track(self, request_id: str, caller: str, ttl_s: float) -> None:
        self.renew(caller, ttl_s)
        self._owner[request_id] = caller
        self._requests.setdefault(caller, set()).add(request_id)

    def release(self, request_id: str) -> None:
        caller = self._owner.pop(request_id, None)
        if caller is None:
            return
        owned = self._requests.get(caller)
        if owned is not None:
            owned.discard(request_id)
            if not owned:
                del self._requests[caller]

    def lapsed_callers(self) -> list[str]:
        """Callers whose lease has run out and that own running requests, which they still
        hold until `expired`. A lapsed caller that owns none is not worth asking after."""
        now = self.clock()
        return [c for c, until in self._until.items() if until <= now and c in self._requests]

    def expired(self) -> list[str]:
        now = self.clock()
        lapsed = [caller for caller, until in self._until.items() if until <= now]
        abandoned: list[str] = []
        for caller in lapsed:
            del self._until[caller]
            for request_id in sorted(self._requests.pop(caller, ())):
                del self._owner[request_id]
                abandoned.append(request_id)
        return abandoned

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    @property
    def num_tracked(self) -> int:
        return len(self._owner)
