"""Prefetch hints: how a router tells an engine replica which adapter is coming, before the
request is admitted there.

Why not call the replica: every call into a Serve replica (a handle call, or a request sent to
the replica's actor) waits for one of its `max_ongoing_requests` slots. The requests that gain
most from a hint are the ones held back in the caller's router because the replica is full, and
a hint sent through the same door would wait behind them.

So hints go around Serve's admission, through a small named Ray actor per engine deployment,
the hint board (`HintBoard`):

    router (in each caller)                board actor                 engine replica
    choose_replicas -> HintSender.send --> post(replica, adapter, eta)
                        (debounced,                       take(replica) <-- follow_hints loop
                         fire-and-forget)                 (long poll)  --> Engine.prefetch_hint

- The router posts one hint per (adapter, replica) per `interval_s` at most, never awaits it,
  and drops hints while the board is not found (looked up by name off the event loop).
- Each replica long-polls the board for its own hints and hands them to its engine's prefetch
  queue. The first replica creates the board (`get_if_exists`); the board is owned by that
  replica, and when it goes away the others create a new one and routers look it up again.
- Hints are advice: a lost hint costs a late load, never a wrong answer. The engine also
  prefetches from its own waiting queue, which covers requests already admitted.

`HintBoard` and `HintDebouncer` are plain Python (tested without Ray); `ray.remote` wraps the
board where it is created.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("ray.serve")

BOARD_NAMESPACE = "lorafleet"
HINT_INTERVAL_S = 0.5  # at most one hint per (adapter, replica) this often
POLL_TIMEOUT_S = 5.0  # a replica's long poll returns empty after this long
RETRY_S = 1.0  # wait after a failed board call or lookup before trying again
MAX_HINTS_PER_REPLICA = 256


def board_name(app_name: str, deployment_name: str) -> str:
    """The hint board's actor name for one engine deployment."""
    return f"hints::{app_name}::{deployment_name}"


class HintDebouncer:
    """Admits one hint per (adapter, replica) per `interval_s`."""

    def __init__(
        self, interval_s: float = HINT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ):
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}

    def admit(self, adapter: str, replica_id: str) -> bool:
        now = self.clock()
        key = (adapter, replica_id)
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[key] = now
        if len(self._last) > 4096:  # forget pairs not hinted lately
            self._last = {k: t for k, t in self._last.items() if now - t < self.interval_s}
        return True


class HintBoard:
    """Pending hints per replica: adapter -> when it is due (this board's clock).

    Routers `post`; each replica `take`s its own, waiting up to `timeout_s` for one to arrive.
    A later hint for the same adapter keeps the earlier due time. Runs as an async Ray actor:
    every method runs on the actor's event loop.
    """

    def __init__(
        self,
        max_per_replica: int = MAX_HINTS_PER_REPLICA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_replica = max_per_replica
        self.clock = clock
        self._pending: dict[str, dict[str, float]] = {}
        self._arrived: dict[str, asyncio.Event] = {}

    async def post(self, replica_id: str, adapter: str, eta_s: float = 0.0) -> None:
        pending = self._pending.setdefault(replica_id, {})
        due = self.clock() + max(0.0, eta_s)
        pending[adapter] = min(due, pending.get(adapter, due))
        while len(pending) > self.max_per_replica:  # the oldest hints go first
            del pending[next(iter(pending))]
        self._event(replica_id).set()

    async def take(
        self, replica_id: str, timeout_s: float = POLL_TIMEOUT_S
    ) -> list[tuple[str, float]]:
        """This replica's pending hints as (adapter, seconds until due, 0 when overdue), waiting
        up to `timeout_s` for the first; [] when none came."""
        event = self._event(replica_id)
        if not self._pending.get(replica_id):
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                return []
        event.clear()
        pending = self._pending.pop(replica_id, {})
        now = self.clock()
        return [(adapter, max(0.0, due - now)) for adapter, due in pending.items()]

    def _event(self, replica_id: str) -> asyncio.Event:
        event = self._arrived.get(replica_id)
        if event is None:
            event = self._arrived[replica_id] = asyncio.Event()
        return event


class HintSender:
    """The router's side: `send` posts a hint to the board without blocking or awaiting.

    `lookup()` returns the board's actor handle or raises (ValueError when it does not exist
    yet); it blocks, so it runs on a worker thread, at most once per `retry_s`. Hints sent while
    the board is unknown are dropped. A failed post forgets the board, so the next hint looks it
    up again (the board is recreated when its owner replica goes away).
    """

    def __init__(
        self,
        lookup: Callable[[], Any],
        *,
        interval_s: float = HINT_INTERVAL_S,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self.debouncer = HintDebouncer(interval_s, clock)
        self.retry_s = retry_s
        self.clock = clock
        self.board: Any = None
        self.num_sent = 0
        self.num_dropped = 0
        self._looking_up: asyncio.Task | None = None
        self._last_lookup = -float("inf")
        self._watching: set[asyncio.Task] = set()

    def send(self, adapter: str, replica_id: str, eta_s: float = 0.0) -> bool:
        """Post a hint unless one for this pair went out within `interval_s`. Must be called on
        the router's event loop. True when posted."""
        board = self.board
        if board is None:
            self._start_lookup()
            self.num_dropped += 1
            return False
        if not self.debouncer.admit(adapter, replica_id):
            return False
        try:
            ref = board.post.remote(replica_id, adapter, eta_s)
        except Exception:
            logger.debug("posting a prefetch hint failed", exc_info=True)
            self.board = None
            return False
        self.num_sent += 1
        self._watch(ref, board)
        return True

    def _start_lookup(self) -> None:
        now = self.clock()
        if self._looking_up is not None or now - self._last_lookup < self.retry_s:
            return
        self._last_lookup = now
        task = asyncio.get_running_loop().create_task(self._find_board())
        self._looking_up = task

    async def _find_board(self) -> None:
        try:
            self.board = await asyncio.to_thread(self._lookup)
        except Exception as e:
            logger.debug("prefetch hint board not available yet: %s", e)
        finally:
            self._looking_up = None

    def _watch(self, ref: Any, board: Any) -> None:
        async def wait() -> None:
            try:
                await ref
            except Exception:
                if self.board is board:
                    self.board = None

        task = asyncio.get_running_loop().create_task(wait())
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)


async def follow_hints(
    replica_id: str,
    get_board: Callable[[], Any],
    deliver: Callable[[list[tuple[str, float]]], Awaitable[None]],
    *,
    poll_timeout_s: float = POLL_TIMEOUT_S,
    retry_s: float = RETRY_S,
) -> None:
    """The replica's side, run as a task until cancelled: long-poll the board for this replica's
    hints and `deliver` each batch. `get_board()` blocks (it may create the board), so it runs
    on a worker thread; after any failure the board is fetched again."""
    board: Any = None  # the board actor's handle, once fetched
    while True:
        try:
            if board is None:
                board = await asyncio.to_thread(get_board)
            hints = await board.take.remote(replica_id, poll_timeout_s)
            if hints:
                await deliver(hints)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug("following prefetch hints failed (retrying): %s", e)
            board = None
            await asyncio.sleep(retry_s)


def get_or_create_board(name: str) -> Any:
    """The board actor named `name`, created (owned by the caller) when missing. Blocks."""
    import ray

    actor_cls = ray.remote(HintBoard)
    return actor_cls.options(
        name=name, namespace=BOARD_NAMESPACE, get_if_exists=True, num_cpus=0
    ).remote()


def lookup_board(name: str) -> Any:
    """The existing board actor named `name`; raises ValueError when there is none. Blocks."""
    import ray

    return ray.get_actor(name, namespace=BOARD_NAMESPACE)
