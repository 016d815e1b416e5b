"""The ingress's metrics, exported through `ray.serve.metrics` to the Ray dashboard's Prometheus
endpoint (names gain Ray's `ray_` prefix there, counters a `_total` suffix).

`backend` is `ray.serve.metrics` or anything with its `Counter`, `Gauge` and `Histogram`
constructors (tests pass a recording fake). Serve adds the deployment, replica and application
tags itself. Tags stay low-cardinality: adapter names are unbounded (adapter_root, run-time loads),
so requests are told apart only by `model_kind` ("base" or "adapter").

- `lorafleet_requests{route, status}`: HTTP requests by route and status code.
- `lorafleet_time_to_first_token_seconds{model_kind}`: arrival at the ingress to the first
  generated token.
- `lorafleet_inter_token_latency_seconds{model_kind}`: between output tokens after the first,
  observed once per `TOKEN_COUNT_PERIOD_S` of a request's stream and when it ends: the time
  from the period's first token's predecessor to its last, over its tokens (a mean, not one
  value a token or a chunk: Ray's histograms take one value a call, and a call a chunk cost the
  ingress about 10 µs a token).
- `lorafleet_request_latency_seconds{model_kind}`: arrival to the last token.
- `lorafleet_output_tokens{model_kind}`, `lorafleet_prompt_tokens{model_kind}`: tokens; their
  rate is tokens/s. A request's output tokens are added up and counted at most
  `TOKEN_COUNT_PERIOD_S` after they arrive and when it ends, not once a chunk: each call into
  Ray's metrics cost the ingress as much as the rest of a chunk's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_GAP_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
TOKEN_COUNT_PERIOD_S = 1.0  # a request's output tokens and gaps wait at most this long
REQUEST_BUCKETS_S = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


def model_kind(adapter: str | None) -> str:
    return "base" if adapter is None else "adapter"


def _serve_metrics() -> ModuleType:
    from ray.serve import metrics

    return metrics


class IngressMetrics:
    def __init__(self, backend: Any = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        m = backend if backend is not None else _serve_metrics()
        self.clock = clock
        self.requests = m.Counter(
            "lorafleet_requests",
            description="HTTP requests to the API, by route and status code.",
            tag_keys=("route", "status"),
        )
        kind = ("model_kind",)
        self.time_to_first_token = m.Histogram(
            "lorafleet_time_to_first_token_seconds",
            description="Time from a request's arrival at the ingress to its first token.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=kind,
        )
        self.inter_token_latency = m.Histogram(
            "lorafleet_inter_token_latency_seconds",
            description="Time between consecutive output tokens of a request.",
            boundaries=TOKEN_GAP_BUCKETS_S,
            tag_keys=kind,
        )
        self.request_latency = m.Histogram(
            "lorafleet_request_latency_seconds",
            description="Time from a request's arrival to its last token.",
            boundaries=REQUEST_BUCKETS_S,
            tag_keys=kind,
        )
        self.output_tokens = m.Counter(
            "lorafleet_output_tokens", description="Tokens generated.", tag_keys=kind
        )
        self.prompt_tokens = m.Counter(
            "lorafleet_prompt_tokens",
            description="Prompt tokens of requests the engine admitted.",
            tag_keys=kind,
        )

    def request_done(self, route: str, status: int) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})

    def generation(self, adapter: str | None, arrival: float) -> GenerationTimer:
        return GenerationTimer(self, model_kind(adapter), arrival)


class GenerationTimer:
    """The timing of one generation: `tokens(n)` as each engine chunk arrives, `finished()`
    once when the request ends normally (not for a client gone), `close()` once however it
    ends (counts the output tokens and the token gaps not yet counted)."""

    def __init__(self, metrics: IngressMetrics, kind: str, arrival: float) -> None:
        self._m = metrics
        self._tags = {"model_kind": kind}
        self._arrival = arrival
        self._last: float | None = None  # when the latest token came
        self._uncounted = 0  # output tokens not yet added to the counter
        self._gap_from = arrival  # the token before the gaps not yet observed
        self._gap_tokens = 0  # tokens since then
        self._counted_at = arrival

    def admitted(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > 0:
            self._m.prompt_tokens.inc(num_prompt_tokens, tags=self._tags)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._m.clock()
        if self._last is None:
            self._m.time_to_first_token.observe(now - self._arrival, tags=self._tags)
            self._gap_from = now
        else:
            self._gap_tokens += n
        self._uncounted += n
        self._last = now
        if now - self._counted_at >= TOKEN_COUNT_PERIOD_S:
            self._count(now)

    def _count(self, now: float) -> None:
        if self._uncounted:
            self._m.output_tokens.inc(self._uncounted, tags=self._tags)
            self._uncounted = 0
        if self._gap_tokens and self._last is not None:
            gap = (self._last - self._gap_from) / self._gap_tokens
            self._m.inter_token_latency.observe(gap, tags=self._tags)
            self._gap_from, self._gap_tokens = self._last, 0
        self._counted_at = now

    def close(self) -> None:
        self._count(self._m.clock())

    def finished(self) -> None:
        self._m.request_latency.observe(self._m.clock() - self._arrival, tags=self._tags)


class RequestCounter:
    """ASGI middleware counting each HTTP request by route and the status it was answered with.
    Paths outside `routes` count as route "other" (keeps the tag bounded); a request that fails
    before answering counts as 500."""

    def __init__(self, app: ASGIApp, *, metrics: IngressMetrics, routes: Iterable[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            route = path if path in self.routes else "other"
            self.metrics.request_done(route, status if status is not None else 500)
