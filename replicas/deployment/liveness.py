"""Whether the callers of an engine replica (ingress replicas' actors) are dead, as Ray's GCS
reports it: asked only of callers whose lease lapsed (`replicas.leases`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from replicas.deployment import ray_runtime

logger = logging.getLogger("ray.serve")


class GcsLiveness:
    """`await liveness(actor_ids)`: those of `actor_ids` that Ray's GCS reports DEAD.

    One read at a time, on a worker thread (the GCS accessor is shared), bounded by `timeout_s`.
    Only a DEAD state counts: an actor the table does not show, a read that fails or times out,
    or a sweep that comes while an earlier read still runs, reports none dead. A slow or
    unavailable GCS delays the abort of a dead caller's requests; it never aborts a live one's.
    `read` (an actor id's state) is injectable for tests.
    """

    def __init__(
        self, timeout_s: float = 2.0, read: Callable[[str], str | None] | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self._read = read if read is not None else ray_runtime.actor_state
        self._reading: asyncio.Future | None = None

    async def __call__(self, actor_ids: list[str]) -> set[str]:
        if self._reading is not None and not self._reading.done():
            return set()  # the GCS has not answered the last sweep yet
        self._reading = asyncio.ensure_future(asyncio.to_thread(self._dead, list(actor_ids)))
        try:
            return await asyncio.wait_for(asyncio.shield(self._reading), self.timeout_s)
        except TimeoutError:
            logger.warning(
                "the GCS did not say within %g s whether callers are alive", self.timeout_s
            )
            return set()

    def _dead(self, actor_ids: list[str]) -> set[str]:
        dead = set()
        for actor_id in actor_ids:
            try:
                state = self._read(actor_id)
            except Exception as e:  # unsure: keep the requests, ask again later
                logger.warning("could not read the state of caller %s: %r", actor_id, e)
                continue
            if state == "DEAD":
                dead.add(actor_id)
        return dead
