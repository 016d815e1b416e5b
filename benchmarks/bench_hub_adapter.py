"""Time from a hub adapter's first request to its first token, beside the same adapter from disk.

    python -m benchmarks.bench_hub_adapter --out benchmarks/results          # CPU, ~2 minutes
    python -m benchmarks.bench_hub_adapter --adapters 2 --rank 8             # quicker

The app runs on a local Ray Serve instance (one engine replica, the embedded demo model on CPU)
with `adapter_root` holding N adapter folders and `hub_adapter_repos` allowing a local hub (the
server the tests use, `tests/hub_server.py`, on 127.0.0.1 through HF_ENDPOINT) that holds the
same N adapters, byte for byte. Each adapter is asked for once cold (its first request: for the
hub, pinning, the config check, the load broadcast, the download into an empty cache, the read;
for disk, the folder check and the read) and once warm, alternating disk and hub, each request
`max_tokens` 1 (its latency is its time to first token, through HTTP). The comparison, same run:
cold hub TTFT over cold disk TTFT, and what the hub adds in ms.

The local hub answers at loopback speed: the figure is the app's own cost of a hub adapter
(metadata round trips, the broadcast, the cache's files), not the internet's. Over a real link,
add the adapter's bytes over the link's bandwidth and a few round trips.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from app.demo import LORA_MODULES, ensure_demo, write_peft_adapter
from benchmarks.common import append_table, write_results
from tests.hub_server import FakeHub

APP = "bench-hub"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_token_s(client: httpx.Client, model: str) -> float:
    body = {"model": model, "prompt": "SELECT", "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"{model}: {r.status_code} {r.text}")
    return elapsed


def run(num_adapters: int, rank: int, scratch: Path) -> tuple[list[dict], dict]:
    import ray
    from ray import serve

    from app.main import CONTROLLER_OPTIONS, build_app

    demo = ensure_demo(scratch / "demo")
    disk, hub = scratch / "adapter_root", FakeHub().start()
    for i in range(num_adapters):
        folder = write_peft_adapter(demo.model_dir, disk / f"disk-{i}", rank=rank,
                                    lora_alpha=2 * rank, target_modules=LORA_MODULES,
                                    seed=100 + i)  # fmt: skip
        hub.push_folder(f"bench/hub-{i}", folder)
    write_peft_adapter(demo.model_dir, disk / "warm", rank=rank, lora_alpha=2 * rank,
                       target_modules=LORA_MODULES, seed=99)  # fmt: skip
    size = (disk / "disk-0" / "adapter_model.safetensors").stat().st_size
    os.environ["HF_ENDPOINT"] = hub.url
    os.environ["HF_HUB_CACHE"] = str(scratch / "hf-cache")  # empty: every hub adapter downloads
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS
        )
        app = build_app(
            {
                "model": str(demo.model_dir),
                "served_model_name": "demo",
                "adapter_root": str(disk),
                "hub_adapter_repos": ["bench/*"],
                "device": "cpu",
                "max_lora_rank": rank,
            }
        )
        serve.run(app, name=APP, route_prefix="/")
        rows = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            _first_token_s(client, "demo")  # warm-up: the engine's first steps, an adapter's
            _first_token_s(client, "warm")
            for i in range(num_adapters):
                for source, model in (("disk", f"disk-{i}"), ("hub", f"bench/hub-{i}")):
                    cold = _first_token_s(client, model)
                    warm = _first_token_s(client, model)
                    rows.append({
                        "adapter": model, "source": source,
                        "cold_ttft_ms": cold * 1e3, "warm_ttft_ms": warm * 1e3,
                    })  # fmt: skip
        serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
        hub.stop()
    return rows, {"adapter_bytes": size, "hub_requests": dict(hub.requests)}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for source in ("disk", "hub"):
        mine = [r for r in rows if r["source"] == source]
        out.append({
            "source": source,
            "adapters": len(mine),
            "cold_ttft_p50_ms": statistics.median(r["cold_ttft_ms"] for r in mine),
            "cold_ttft_max_ms": max(r["cold_ttft_ms"] for r in mine),
            "warm_ttft_p50_ms": statistics.median(r["warm_ttft_ms"] for r in mine),
        })  # fmt: skip
    disk, hub = out
    hub["hub_over_disk"] = hub["cold_ttft_p50_ms"] / disk["cold_ttft_p50_ms"]
    hub["hub_adds_ms"] = hub["cold_ttft_p50_ms"] - disk["cold_ttft_p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=6, help="adapters of each source")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None, help="write results here (benchmarks/results)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-hub-"))
    try:
        rows, extra = run(args.adapters, args.rank, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(rows)
    for row in summary:
        print(row)
    if args.out:
        path = write_results(
            args.out,
            "hub_adapter_ttft",
            "First request to first token: a hub adapter from a local hub vs. the same from disk",
            "cold hub TTFT P50 over cold disk TTFT P50 (same adapters, same run)",
            [
                "source",
                "adapters",
                "cold_ttft_p50_ms",
                "cold_ttft_max_ms",
                "warm_ttft_p50_ms",
                "hub_over_disk",
                "hub_adds_ms",
            ],  # fmt: skip
            summary,
            extra={**extra, "rank": args.rank, "model": "embedded demo (CPU)"},
        )
        append_table(path, "Each request (ms, through HTTP, max_tokens 1)",
                     ["adapter", "source", "cold_ttft_ms", "warm_ttft_ms"], rows)  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
