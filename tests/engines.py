"""Engines for tests that must hold requests where they want them."""

from __future__ import annotations

from replicas.engine import Engine


class GatedEngine(Engine):
    """An engine whose steps a test holds back. `hold` "queued": no step runs, so a new request
    stays queued; "started": steps run until every request has its first token, then stop, so
    it stays running; "open": steps run as usual. Held, the engine thread still runs everything
    else (loads, unloads, stats), so a test keeps a request in flight for as long as it needs
    instead of hoping to catch it before it finishes. Set through `AsyncEngine.call` (on the
    engine thread, which also wakes it)."""

    hold: str = "open"

    def set_hold(self, hold: str) -> None:
        assert hold in ("open", "queued", "started"), hold
        self.hold = hold

    def held_requests(self, status: str) -> int:
        """Requests held where `status` ("queued" or "started") holds them."""
        if status == "queued":
            return len(self.scheduler.waiting)
        return sum(bool(r.output_token_ids) for r in self.scheduler.running)

    @property
    def has_work(self) -> bool:
        if self.hold == "queued":
            return False
        if self.hold == "started":
            sched = self.scheduler
            if not sched.waiting and all(r.output_token_ids for r in sched.running):
                return False
        return super().has_work


class FailingEngine(Engine):
    """An engine whose every step raises: the loop must fail the requests in flight and go on."""

    def step(self, on_idle=None):
        raise RuntimeError("the device fell over")
