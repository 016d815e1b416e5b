"""What Serve's own request path costs the host with nothing of ours in it: the floor under the
served path's CPU a request (docs/perf/serving.md, "Serve's floor a request").

    python -m benchmarks.bench_serve_floor                   # 1,024 requests, 128 at once
    python -m benchmarks.bench_serve_floor --requests 4096 --concurrency 512

Serve is started with the app's own settings (`app.main.CONTROLLER_OPTIONS`: HAProxy in front;
`app.main.replica_env()` for each replica), and one null ingress and one null engine deployment
are deployed the way `app.main.build_app` deploys ours. Two routes, each a row:

- `http`: the ingress streams two server-sent events (the first token, then the end) `--hold-s`
  apart and calls nothing: HAProxy, uvicorn, Serve's direct ingress and FastAPI.
- `http + engine call`: the same, with the events taken from one streaming call to the null
  engine (`app.ingress.engine_handle`, gRPC, a multiplexed model id, Serve's default router):
  what every request of the app pays besides its own work, as ours carries its first and last
  chunk on its own call and the tokens between on a shared channel.
- `http + batched engine calls`: the requests that reach the ingress within `--flush-s` of
  each other go to the engine as one call, and every request's events come back on one
  streaming call per ingress: what the requests' own calls cost, seen from the other side
  (the floor were the app to send its requests in batches on its channel).

Each row: a warm-up burst, the serving processes' CPU over an idle period (`--idle-s`: its rate,
over the burst's duration, is subtracted), then `--requests` requests with `--concurrency` open
at once. Figures: each role's CPU a request (proxy: HAProxy and Serve's proxy; the ingress; the
engine replica), their idle rates, and the sum a token at `--output-tokens` (128: the saturated
workload's outputs), set against the 50 µs a token the served path aims at.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import serve_on, write_results

APP_NAME = "serve-floor"
ROUTE = "/serve-floor"
ROLES = ("proxy", "ingress", "engine")
TARGET_US_PER_TOKEN = 50.0  # the served path's aim (host CPU a delivered token)
ROWS = {
    "http": "/v1/null",
    "http + engine call": "/v1/call",
    "http + batched engine calls": "/v1/batched",
}


def build_app(hold_s: float, flush_s: float) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray import serve

    from app.ingress import engine_handle
    from app.main import replica_env

    api = FastAPI()
    options = {"num_cpus": 0, "runtime_env": {"env_vars": replica_env()}}

    @serve.deployment(max_ongoing_requests=100_000, ray_actor_options=options)
    class NullEngine:
        def __init__(self) -> None:
            self._outboxes: dict[str, asyncio.Queue] = {}  # caller -> (request id, last) events

        async def generate(self, request: str, caller: str):  # noqa: ANN201
            yield request
            await asyncio.sleep(hold_s)
            yield request

        async def channel(self, caller: str):  # noqa: ANN201
            """Every event of `caller`'s submitted requests, as many as are ready an item."""
            outbox = self._outboxes.setdefault(caller, asyncio.Queue())
            yield []  # open: submissions may follow
            while True:
                events = [await outbox.get()]
                while not outbox.empty():
                    events.append(outbox.get_nowait())
                yield events

        async def submit(self, caller: str, request_ids: list[str]) -> int:
            outbox = self._outboxes[caller]
            for rid in request_ids:
                outbox.put_nowait((rid, False))

            def finish() -> None:
                for rid in request_ids:
                    outbox.put_nowait((rid, True))

            asyncio.get_running_loop().call_later(hold_s, finish)
            return len(request_ids)

    @serve.deployment(max_ongoing_requests=100_000, ray_actor_options=options)
    @serve.ingress(api)
    class NullIngress:
        def __init__(self, engine: Any) -> None:
            self._engine = engine_handle(engine)
            # The batched route: requests submitted an interval at a time, their events back
            # on one channel.
            self._caller = uuid.uuid4().hex
            self._waiting: dict[str, asyncio.Queue] = {}  # request id -> its events
            self._batch: list[str] = []
            self._opened: asyncio.Event | None = None
            self._tasks: set[asyncio.Task] = set()

        async def _read_channel(self, opened: asyncio.Event) -> None:
            response: Any = self._engine.options(stream=True).channel.remote(self._caller)
            async for events in response:
                opened.set()
                for rid, last in events:
                    waiting = self._waiting.get(rid)
                    if waiting is not None:
                        waiting.put_nowait(last)

        def _flush(self) -> None:
            batch, self._batch = self._batch, []
            task = asyncio.ensure_future(self._engine.submit.remote(self._caller, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        # No annotations: FastAPI resolves them in the module's globals, not this scope.
        @api.post(ROWS["http"], response_model=None)
        async def null(self):  # noqa: ANN202
            async def events():
                yield b"data: {}\n\n"
                await asyncio.sleep(hold_s)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @api.post(ROWS["http + engine call"], response_model=None)
        async def call(self):  # noqa: ANN202
            stream = self._engine.options(stream=True, multiplexed_model_id="a").generate
            response = stream.remote("request", "caller")

            async def events():
                async for _ in response:
                    yield b"data: {}\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @api.post(ROWS["http + batched engine calls"], response_model=None)
        async def batched(self):  # noqa: ANN202
            if self._opened is None:
                self._opened = asyncio.Event()
                reader = asyncio.create_task(self._read_channel(self._opened))
                self._tasks.add(reader)
            await self._opened.wait()
            rid = uuid.uuid4().hex
            waiting: asyncio.Queue = asyncio.Queue()
            self._waiting[rid] = waiting
            self._batch.append(rid)
            if len(self._batch) == 1:
                asyncio.get_running_loop().call_later(flush_s, self._flush)

            async def events():
                try:
                    while not await waiting.get():
                        yield b"data: {}\n\n"
                    yield b"data: [DONE]\n\n"
                finally:
                    self._waiting.pop(rid, None)

            return StreamingResponse(events(), media_type="text/event-stream")

    return NullIngress.bind(NullEngine.bind())  # type: ignore[attr-defined]


async def send(url: str, n: int, concurrency: int, body_bytes: int) -> float:
    """`n` streaming requests, `concurrency` open at once; returns the seconds they took.
    Raises if one does not end 200."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    body = {"model": "a", "prompt": "x" * body_bytes, "stream": True}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one() -> None:
            async with gate, client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"status {r.status_code}")
                async for _ in r.aiter_bytes():
                    pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0


def role_cpu_s(processes: list) -> dict[str, float]:
    """User + system CPU seconds by role over `processes` (from /proc)."""
    from benchmarks.serve_cpu import read_all

    seconds = read_all(processes)
    out = dict.fromkeys(ROLES, 0.0)
    for p in processes:
        if p.role in out and p.pid in seconds:
            out[p.role] += seconds[p.pid]
    return out


def figures(
    busy: dict[str, float],
    idle: dict[str, float],
    idle_s: float,
    duration_s: float,
    n: int,
    output_tokens: int,
) -> dict[str, Any]:
    """A row's figures: each role's CPU a request over the burst, less its idle rate over the
    burst's duration (never below zero: a clock tick is 10 ms), and their sum a token."""
    row: dict[str, Any] = {"requests": n, "duration_s": duration_s}
    total = 0.0
    for role in ROLES:
        rate = idle[role] / idle_s if idle_s > 0 else 0.0
        net = max(0.0, busy[role] - rate * duration_s)
        row[f"{role}_ms_per_request"] = 1e3 * net / n
        row[f"{role}_idle_cores"] = rate
        total += net
    row["ms_per_request"] = 1e3 * total / n
    row["us_per_token"] = 1e6 * total / n / output_tokens
    row["of_target"] = row["us_per_token"] / TARGET_US_PER_TOKEN
    return row


def measure(url: str, processes: list, args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(send(url, args.warmup, args.concurrency, args.body_bytes))
    time.sleep(0.5)  # the warm-up's last streams close
    before = role_cpu_s(processes)
    time.sleep(args.idle_s)
    idle = {r: s - before[r] for r, s in role_cpu_s(processes).items()}
    before = role_cpu_s(processes)
    duration = asyncio.run(send(url, args.requests, args.concurrency, args.body_bytes))
    busy = {r: s - before[r] for r, s in role_cpu_s(processes).items()}
    return figures(busy, idle, args.idle_s, duration, args.requests, args.output_tokens)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start Ray and Serve on `args.port` (or deploy beside a running one, as the tests do),
    measure each row, shut down or delete what was started."""
    from ray import serve

    from app.main import CONTROLLER_OPTIONS
    from benchmarks.serve_cpu import serving_processes

    with serve_on(args.port, APP_NAME, CONTROLLER_OPTIONS) as port:
        serve.run(build_app(args.hold_s, args.flush_s), name=APP_NAME, route_prefix=ROUTE)
        processes = serving_processes(APP_NAME, "NullIngress", "NullEngine")
        rows = []
        for what, path in ROWS.items():
            url = f"http://127.0.0.1:{port}{ROUTE}{path}"
            rows.append({"what": what} | measure(url, processes, args))
            # In the log too: a device call may not bring every results file back.
            print(json.dumps(rows[-1]), flush=True)
        return rows


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=128, help="requests open at once")
    ap.add_argument("--hold-s", type=float, default=0.2, help="first to last event, a request")
    ap.add_argument(
        "--flush-s",
        type=float,
        default=0.002,
        help="the batched route: how long new requests gather before one submit call",
    )
    ap.add_argument("--body-bytes", type=int, default=2000, help="prompt characters a request")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle period measured, a row")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens a request, for µs/token")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--name", default="serve_floor")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    counts = (args.requests, args.warmup, args.concurrency, args.output_tokens)
    if min(counts) < 1 or args.hold_s < 0 or args.idle_s <= 0 or args.flush_s < 0:
        ap.error("--requests, --warmup, --concurrency, --output-tokens >= 1; --hold-s >= 0; "
                 "--idle-s > 0; --flush-s >= 0")  # fmt: skip
    rows = run(args)
    columns = ["what", "requests", "duration_s", "proxy_ms_per_request", "ingress_ms_per_request",
               "engine_ms_per_request", "ms_per_request", "us_per_token", "of_target"]  # fmt: skip
    return write_results(
        args.out,
        args.name,
        "Serve's own request path: host CPU a request with null handlers",
        f"the floor a token at {args.output_tokens}-token outputs against the served path's aim "
        f"of {TARGET_US_PER_TOKEN:g} µs a token (of_target)",
        columns,
        rows,
        extra={
            "concurrency": args.concurrency,
            "hold_s": args.hold_s,
            "flush_s": args.flush_s,
            "body_bytes": args.body_bytes,
            "output_tokens": args.output_tokens,
            "idle_s": args.idle_s,
            "cpus": os.cpu_count(),
        },  # fmt: skip
    )


if __name__ == "__main__":
    print(main(sys.argv[1:]))
