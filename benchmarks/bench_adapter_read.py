"""How long does an adapter take from disk to (pinned) host memory, and what slows it down?

    python -m benchmarks.bench_adapter_read --out benchmarks/results        # GPU (pinned memory)
    python -m benchmarks.bench_adapter_read --rank 16 --reads 4             # CPU works too
    python -m benchmarks.bench_adapter_read --smoke                         # tiny model, CPU

The read path is what `AdapterManager` runs on its worker pool: `read_adapter_file` (one read of
the file, header parse and checks) then `LoraWeightPool.pack_file` (the slot image, one pinned
buffer per layer). Measured for a Llama-3-8B-shaped adapter whose file is in the page cache:

- each phase alone on an idle process: the file read (`np.fromfile`), the parse, and the pack,
  split into pinned allocation and the copies;
- the whole read on a worker thread while the main thread runs a step loop like the engine's
  (bursts of small kernel launches, then an event poll), one read at a time and four at once.

The comparison is the whole read against the plain file read of the same bytes (same run): the
pack's share is what a better read path can still remove, and the worker-thread rows against the
idle row say what contention with the step loop costs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import dummy_fleet, write_results
from replicas.adapters.loader import read_adapter_file
from replicas.adapters.peft_config import WEIGHTS_FILE
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from synthetic.presets import LLAMA3_8B, TINY


def step_loop(stop: threading.Event, device: torch.device) -> None:
    """The engine's shape on the main thread: ~300 small launches, then poll an event."""
    x = torch.zeros(1024, device=device)
    while not stop.is_set():
        for _ in range(300):
            x.add_(1.0)
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            while not done.query():
                time.sleep(1e-4)


def beside_step_loop(
    read, names: list[str], concurrent: int, total: int, kept: list, device: torch.device
) -> list[float]:
    """Read times of `total` reads, `concurrent` at a time on a worker pool, while this (the
    main) thread runs the step loop."""
    stop = threading.Event()
    times: list[float] = []
    with ThreadPoolExecutor(4) as workers:

        def reads() -> None:
            for _ in range(max(1, total // concurrent)):
                futures = [workers.submit(read, names[i % len(names)]) for i in range(concurrent)]
                times.extend(f.result() for f in futures)
                kept.clear()
            stop.set()

        side = threading.Thread(target=reads)
        side.start()
        step_loop(stop, device)
        side.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reads", type=int, default=8, help="reads per measurement")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny model: checks the script runs")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [f"a{i}" for i in range(4)]
    model, folders = dummy_fleet("read-", TINY if args.smoke else LLAMA3_8B, names, args.rank)
    spec = ModelSpec.from_dir(model)
    fleet = {k: Path(v) for k, v in folders.items()}
    pool = LoraWeightPool(spec, 1, args.rank, torch.bfloat16, device, "torch")
    kept: list = []  # packed adapters stay alive, like a host cache that has not evicted yet

    def read(name: str) -> float:
        t0 = time.perf_counter()
        kept.append(pool.pack_file(read_adapter_file(name, fleet[name], spec, args.rank)))
        return 1e3 * (time.perf_counter() - t0)

    for name in names:  # page cache and allocator warm
        read(name)
    kept.clear()
    nbytes = (fleet[names[0]] / WEIGHTS_FILE).stat().st_size

    def phases(name: str) -> dict:
        t0 = time.perf_counter()
        np.fromfile(fleet[name] / WEIGHTS_FILE, dtype=np.uint8)
        t1 = time.perf_counter()
        file = read_adapter_file(name, fleet[name], spec, args.rank)
        t2 = time.perf_counter()
        kept.append(pool.pack_file(file))
        t3 = time.perf_counter()
        buf = torch.empty(pool.slot_elems * 2, dtype=torch.uint8, pin_memory=device.type == "cuda")
        t4 = time.perf_counter()
        del buf
        return {
            "file_read_ms": 1e3 * (t1 - t0),
            "read_parse_ms": 1e3 * (t2 - t1),
            "pack_ms": 1e3 * (t3 - t2),
            "alloc_one_layer_ms": 1e3 * (t4 - t3),
        }

    samples = [phases(names[i % len(names)]) for i in range(args.reads)]
    idle = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    kept.clear()
    fresh = [read(names[i % len(names)]) for i in range(args.reads)]  # reused pinned blocks
    kept.clear()
    rows = [{"case": "phases, idle", **idle, "read_ms": statistics.median(fresh)}]

    for concurrent in (1, 4):
        times = beside_step_loop(read, names, concurrent, args.reads, kept, device)
        rows.append(
            {
                "case": f"{concurrent} at once, beside a step loop",
                "read_ms": statistics.median(times),
            }
        )
    for row in rows:
        row["read_over_file_read"] = row["read_ms"] / idle["file_read_ms"]
        print(row)
    if args.out:
        write_results(
            args.out,
            f"adapter_read_r{args.rank}",
            f"Disk -> pinned host read of a rank-{args.rank} adapter, "
            f"{'tiny' if args.smoke else 'Llama-3-8B'} shape "
            f"({nbytes / 1e6:.0f} MB file, in the page cache)",
            "read_ms against file_read_ms (the file's bytes alone, same run): the rest is parse "
            "and pack; rows beside a step loop against the idle row: contention",
            [
                "case",
                "read_ms",
                "read_over_file_read",
                "file_read_ms",
                "read_parse_ms",
                "pack_ms",
                "alloc_one_layer_ms",
            ],
            rows,
        )


if __name__ == "__main__":
    main()
