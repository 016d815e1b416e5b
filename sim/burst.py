"""How a burst of requests reaches a server: the warm-up arrivals of the simulator's cells.

    python -m sim.burst [--repeats 10] [--cell easy-4x]

`benchmarks/bench_router_serve.py` sends each cell's warm-up "all at once" (loadgen's `warm_up`:
`asyncio.gather` over the list). One client cannot send two requests at one instant: this sends
the cell's warm-up the same way (loadgen's `OpenAIClient`, streaming) to a local HTTP server
(uvicorn and FastAPI, Serve's proxy's stack, in a process of its own, answering each request
with one token) and prints, per burst, how long the requests took to arrive and how far their
order strayed from the order sent (inversions: pairs that arrived the other way round, of
n(n-1)/2). The server is as fast as a server gets; Serve's proxy and the ingress replicas only
add time. CPU only, no Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = """
import time
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

app = FastAPI()
arrivals = []


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    arrivals.append((time.time(), body["model"]))

    async def tokens():
        yield 'data: {"choices": [{"text": "x"}]}\\n\\n'
        yield "data: [DONE]\\n\\n"

    return StreamingResponse(tokens(), media_type="text/event-stream")


@app.get("/arrivals")
async def taken():
    out = list(arrivals)
    arrivals.clear()
    return out
"""


def inversions(order: list[int]) -> int:
    """Pairs (i < j) with order[i] > order[j]."""
    return sum(1 for i, a in enumerate(order) for b in order[i + 1 :] if a > b)


async def bursts(url: str, cell_name: str, repeats: int) -> list[dict[str, float]]:
    import httpx

    from loadgen.client import OpenAIClient
    from loadgen.runner import warm_up
    from sim.cells import CELLS
    from workloads.requests import LengthRange
    from workloads.router_cell import adapter_names, cell_requests

    cell = CELLS[cell_name]
    warm = cell_requests(
        adapter_names(cell.num_adapters),
        slots=cell.slots,
        replicas=cell.replicas,
        num_requests=cell.num_requests,
        popularity=cell.popularity,
        input_len=LengthRange(*cell.input_len),
        output_len=LengthRange(*cell.output_len),
        seed=cell.seed,
    ).warmup
    position = {spec.model: i for i, spec in enumerate(warm)}
    out = []
    for _ in range(repeats):
        async with OpenAIClient(url) as client:
            await warm_up(client, warm, len(warm))
        arrived = sorted(httpx.get(f"{url}/arrivals").json())
        times = [t for t, _ in arrived]
        out.append({
            "requests": len(arrived),
            "spread_ms": 1e3 * (times[-1] - times[0]),
            "inversions": inversions([position[model] for _, model in arrived]),
            "pairs": len(arrived) * (len(arrived) - 1) // 2,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="easy-4x", help="whose warm-up to send (sim.cells)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--port", type=int, default=8124)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "burst_server.py").write_text(SERVER)
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "burst_server:app", "--port", str(args.port),
             "--log-level", "warning"],
            cwd=folder,
        )  # fmt: skip
        try:
            time.sleep(3.0)  # the server starts
            rows = asyncio.run(bursts(f"http://127.0.0.1:{args.port}", args.cell, args.repeats))
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(json.dumps(rows, indent=1))
    spreads = sorted(r["spread_ms"] for r in rows)
    print(f"spread: {spreads[0]:.1f}-{spreads[-1]:.1f} ms, median {spreads[len(spreads) // 2]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
