"""How fast Serve's HTTP proxy hands a burst of new requests on to an ingress: the ceiling of
the ramp a saturated burst pays before the engines fill (docs/perf/serving.md, "Where a burst
waits, by hop").

    python -m benchmarks.bench_proxy_intake                      # 600 requests, 2 ingresses
    python -m benchmarks.bench_proxy_intake --requests 2048 --ingress-replicas 8

Serve is started with the app's own proxy settings (`app.main.CONTROLLER_OPTIONS`: HAProxy in
front, or Serve's proxy with `RAY_SERVE_ENABLE_HA_PROXY=0` set, each access line written at
once) and ingress settings (`app.main.REPLICA_ENV`), in front of an ingress that does nothing:
a FastAPI route that stamps when it was called (`replicas.hop_log`), streams one event, holds
the stream `--hold-s` (so every request of the burst is open at once, as under a saturated
load) and ends. A warm-up burst, then the measured one, all sent at once by one load
generator. Figures: the proxy's start of each request (its access line; none from HAProxy),
the ingress route's start, the time between them, the rate at which requests reached the
ingresses, and the proxy processes' CPU over the burst per request. The comparison it exists
for: how long one proxy takes to hand on a full batch (`max_num_seqs`, 128) to each of N
engine replicas at that rate, against the ~0.5 s an H200 takes to prefill one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import serve_on, write_results
from benchmarks.serve_hops import quantile, read_hops, read_proxy_log
from replicas import hop_log

APP_NAME = "proxy-intake"
ROUTE = "/proxy-intake"
BATCH = 128  # max_num_seqs of the GPU configs: the requests that fill one engine replica


def build_ingress(stamps: str, hold_s: float, num_replicas: int) -> Any:
    """The null ingress; each replica stamps its requests into the hop log `stamps`."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray import serve

    from app.main import replica_env

    api = FastAPI()
    env = replica_env() | {hop_log.ENV: stamps}

    @serve.deployment(
        max_ongoing_requests=100_000,
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
    )
    @serve.ingress(api)
    class NullIngress:
        # No annotations: FastAPI resolves them in the module's globals, not this scope.
        @api.post("/v1/completions", response_model=None)
        async def completions(self):  # noqa: ANN202
            hop_log.stamp("ingress_asgi")

            async def events():
                yield b"data: {}\n\n"
                await asyncio.sleep(hold_s)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return NullIngress.bind()


async def send_burst(url: str, n: int, body_bytes: int) -> float:
    """`n` streaming requests at once; returns when they were sent (unix time). Raises if one
    does not end 200."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    body = {"model": "base", "prompt": "x" * body_bytes, "stream": True}
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one() -> None:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"status {r.status_code}")
                async for _ in r.aiter_bytes():
                    pass

        t0 = time.time()
        await asyncio.gather(*(one() for _ in range(n)))
        return t0


def proxy_processes() -> list:
    """This node's proxy processes: Serve's proxy, and in HAProxy mode (`app.main.PROXY_ENV`)
    its manager and the haproxy it runs (`spawned`)."""
    from benchmarks.serve_cpu import serving_processes

    return [p for p in serving_processes(APP_NAME, "NullIngress", "") if p.role == "proxy"]


def proxy_cpu_s(proxies: list) -> float | None:
    """User + system CPU seconds of `proxies` (from /proc), None if none is found."""
    from benchmarks.serve_cpu import cpu_seconds

    seconds = [s for p in proxies if (s := cpu_seconds(p.pid)) is not None]
    return sum(seconds) if seconds else None


def figures(
    t0: float, arrivals: dict[str, float], begins: dict[str, float], n: int, cpu_s: float | None
) -> dict[str, Any]:
    """The measured burst's figures from its ingress arrivals and proxy begins (unix times)."""
    burst = {rid: t for rid, t in arrivals.items() if t >= t0}
    if len(burst) != n:
        raise RuntimeError(f"{len(burst)} of {n} requests reached the ingress")
    at = sorted(t - t0 for t in burst.values())
    lags = [burst[rid] - begins[rid] for rid in burst if rid in begins]
    span = at[-1] - at[0]
    rate = (n - 1) / span if span > 0 else float("inf")
    out: dict[str, Any] = {
        "requests": n,
        "reached_ingress_first_s": at[0],
        "reached_ingress_last_s": at[-1],
        "forward_rate_req_s": rate,
        "proxy_cpu_ms_per_request": None if cpu_s is None else 1e3 * cpu_s / n,
        "proxy_lines": len(lags),
    }
    if lags:
        out |= {
            "lag_p50_s": quantile(lags, 0.5),
            "lag_p90_s": quantile(lags, 0.9),
            "lag_max_s": max(lags),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start Ray and Serve on `args.port`, measure, shut both down. In a process already
    connected to a cluster with Serve on `args.port` (the tests'), the ingress is deployed there
    under its own route and deleted after (that proxy's access lines may come in batches: the
    lags are then left out)."""
    import ray
    from ray import serve

    from app.main import CONTROLLER_OPTIONS

    env = dict(CONTROLLER_OPTIONS["runtime_env"]["env_vars"])
    env["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"] = "1"  # every access line, at once
    stamps = tempfile.mkdtemp(prefix="proxy-intake-")
    with serve_on(args.port, APP_NAME, {"runtime_env": {"env_vars": env}}) as port:
        ingress = build_ingress(stamps, args.hold_s, args.ingress_replicas)
        serve.run(ingress, name=APP_NAME, route_prefix=ROUTE)
        url = f"http://127.0.0.1:{port}{ROUTE}"
        asyncio.run(send_burst(url, args.warmup, args.body_bytes))
        time.sleep(1.0)
        proxies = proxy_processes()
        cpu0 = proxy_cpu_s(proxies)
        t0 = asyncio.run(send_burst(url, args.requests, args.body_bytes))
        cpu1 = proxy_cpu_s(proxies)
        time.sleep(1.0)  # the last access lines reach the log
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
        begins = read_proxy_log([logs])
        arrivals = {
            rid: hops["ingress_asgi"]
            for rid, hops in read_hops([Path(stamps)]).items()
            if "ingress_asgi" in hops
        }
        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        haproxies = sum(p.spawned for p in proxies)
        return figures(t0, arrivals, begins, args.requests, cpu) | {"haproxy_processes": haproxies}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ingress-replicas", type=int, default=2)
    ap.add_argument("--hold-s", type=float, default=2.0, help="how long each stream stays open")
    ap.add_argument("--body-bytes", type=int, default=2000, help="prompt characters a request")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.requests < 2 or args.warmup < 1 or args.ingress_replicas < 1 or args.hold_s < 0:
        ap.error("--requests >= 2, --warmup >= 1, --ingress-replicas >= 1, --hold-s >= 0")
    result = run(args)
    rate = result["forward_rate_req_s"]
    rows = [result | {"what": "measured burst"}]
    for n in (1, 2, 4, 8):
        rows.append({"what": f"{n} engine replica(s): a batch of {BATCH} each handed on",
                     "fill_s": n * BATCH / rate})  # fmt: skip
    columns = ["what", "requests", "forward_rate_req_s", "proxy_cpu_ms_per_request", "lag_p50_s",
               "lag_p90_s", "lag_max_s", "reached_ingress_last_s", "fill_s"]  # fmt: skip
    name = args.name or f"proxy_intake_{args.ingress_replicas}ing"
    return write_results(
        args.out,
        name,
        "Serve's proxy: how fast a burst of new requests reaches the ingresses",
        "the proxy's forward rate, and the time one proxy takes to hand a full batch to each "
        "of N engine replicas at it (an H200 prefills one in about 0.5 s)",
        columns,
        rows,
        extra={
            "ingress_replicas": args.ingress_replicas,
            "hold_s": args.hold_s,
            "body_bytes": args.body_bytes,
            "cpus": os.cpu_count(),
        },  # fmt: skip
    )


if __name__ == "__main__":
    print(main(sys.argv[1:]))
