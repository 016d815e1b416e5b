"""Shared helpers for benchmarks: timing with CUDA events, the HBM bandwidth of this device, a
local server's port and health, and writing results (markdown table + JSON) with the command,
device and date."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str | None:
    """The tree's commit: `COMMIT` from the environment (a GPU machine gets the working tree
    without its history), else git's HEAD, else None."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() or None


def time_cuda(
    fn: Callable[[], object], iters: int = 50, repeats: int = 5, warmup: int = 5
) -> float:
    """Median over `repeats` of the mean time of `iters` calls, in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(samples)


def graph_replay_us(step: Callable[[], object], iters: int = 20) -> float:
    """`step` captured into one CUDA graph (after a run on a side stream, which compiles kernels
    and settles allocations outside the capture); µs per replay, as `time_cuda`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    us = time_cuda(graph.replay, iters=iters, repeats=7, warmup=3)
    del graph
    return us


def smoke_or_gpu_parser(doc: str) -> argparse.ArgumentParser:
    """A kernel benchmark's parser, with the `--smoke` and `--out` that `run_smoke_or_gpu` reads."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, no GPU needed")
    ap.add_argument(
        "--out",
        default=None,
        help="results folder (default benchmarks/results on GPU; none in --smoke)",
    )
    return ap


def run_smoke_or_gpu(args: argparse.Namespace, run_smoke: Callable, run_gpu: Callable) -> None:
    """A benchmark's entry: `--smoke` runs Triton's interpreter on CPU (chosen before triton is
    first imported), anything else needs a CUDA GPU and writes to benchmarks/results unless
    `--out` says where."""
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        run_smoke(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU; use --smoke to check the plumbing on CPU")
    args.out = args.out or "benchmarks/results"
    run_gpu(args)


def hbm_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), iters=20, repeats=5)
    return 2 * nbytes / (us * 1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_on(port: int | None, app_name: str, controller_options: dict) -> Iterator[int]:
    """A local cluster with Serve's HTTP on `port` (a free one if None), for one benchmark
    app: yields the port. In a process already connected to a cluster with Serve on `port`
    (the tests'), nothing is started and only `app_name` is deleted after; otherwise Ray and
    Serve are started with `controller_options` and shut down after."""
    import ray
    from ray import serve

    owned = not ray.is_initialized()
    port = port or free_port()
    if owned:
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False)
    try:
        if owned:
            serve.start(
                http_options={"host": "127.0.0.1", "port": port},
                controller_options=controller_options,
            )
        yield port
    finally:
        if owned:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(app_name)


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


def dummy_fleet(prefix: str, config: dict, names: list[str], rank: int) -> tuple[Path, dict]:
    """A temporary folder with a model of `config`'s shape for `load_format: dummy`
    (`model/config.json`) and rank-`rank` adapters `names` beside it: the model folder, and
    name -> adapter folder."""
    from replicas.models.spec import ModelSpec
    from synthetic.adapters import write_fleet

    model = Path(tempfile.mkdtemp(prefix=prefix)) / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model, write_fleet(model.parent, ModelSpec.from_dir(model), names, rank)


def write_results(
    out_dir: str | Path,
    name: str,
    title: str,
    comparison: str,
    columns: list[str],
    rows: list[dict],
    extra: dict | None = None,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python " + " ".join(sys.argv),
        "device": device_name(),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "comparison": comparison,
        **(extra or {}),
    }
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return out / f"{name}.md"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def append_table(path: str | Path, title: str, columns: list[str], rows: list[dict]) -> None:
    """Add a titled table to a markdown results file written by `write_results`."""
    lines = ["", f"## {title}", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + " --- |" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
