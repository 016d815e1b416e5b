"""Does a step's small host->GPU copy wait behind an adapter copy on the load stream?

    python -m benchmarks.bench_copy_overlap --out benchmarks/results     # GPU

A step stages its metadata (token ids, positions, block tables, sampling parameters) with small
non-blocking host->GPU copies on the compute stream, while the prefetcher copies adapters from
pinned memory on a load stream. If both directions' copies share one copy engine in issue order,
the step's first kernel cannot start until the adapter bytes enqueued before its metadata have
crossed PCIe, and per-layer load events hide nothing. This measures, for an adapter of each size
(one copy per layer, as `LoraWeightPool.write` issues them): the latency of a 4 KB copy on another
stream enqueued just after the adapter's copies, against the same copy alone and against the
adapter copy's own duration; and the same for a small kernel (no copy) on the other stream.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import write_results

LAYERS = 32


def _latency_ms(enqueue, repeats: int = 10) -> float:
    """Median host-observed time from enqueueing `enqueue()`'s work to its event completing."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        t0 = time.perf_counter()
        enqueue(done)
        done.synchronize()
        samples.append(1000 * (time.perf_counter() - t0))
    return statistics.median(samples)


def measure(adapter_mb: float) -> dict:
    layer_bytes = int(adapter_mb * 1e6 / LAYERS)
    host = [torch.empty(layer_bytes, dtype=torch.uint8).pin_memory() for _ in range(LAYERS)]
    dev = [torch.empty(layer_bytes, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    small_host = torch.empty(4096, dtype=torch.uint8).pin_memory()
    small_dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
    x = torch.randn(1024, device="cuda")
    load, compute = torch.cuda.Stream(), torch.cuda.Stream()

    def adapter(done):
        with torch.cuda.stream(load):
            for h, d in zip(host, dev, strict=True):
                d.copy_(h, non_blocking=True)
            done.record(load)

    def small_copy(done):
        with torch.cuda.stream(compute):
            small_dev.copy_(small_host, non_blocking=True)
            done.record(compute)

    def small_kernel(done):
        with torch.cuda.stream(compute):
            x.mul_(1.0)
            done.record(compute)

    def behind(first, second):
        def enqueue(done):
            first(torch.cuda.Event())
            second(done)
        return enqueue

    _latency_ms(adapter, 3)  # warm-up
    _latency_ms(small_copy, 3)
    _latency_ms(small_kernel, 3)
    return {
        "adapter_MB": adapter_mb,
        "adapter_copy_ms": _latency_ms(adapter),
        "small_copy_alone_ms": _latency_ms(small_copy),
        "small_copy_behind_adapter_ms": _latency_ms(behind(adapter, small_copy)),
        "small_kernel_alone_ms": _latency_ms(small_kernel),
        "small_kernel_behind_adapter_ms": _latency_ms(behind(adapter, small_kernel)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sizes-mb", default="84,671")
    args = ap.parse_args()
    rows = [measure(float(mb)) for mb in args.sizes_mb.split(",")]
    for row in rows:
        row["small_copy_delay_over_adapter_copy"] = (
            row["small_copy_behind_adapter_ms"] / row["adapter_copy_ms"]
        )
        print(row, flush=True)
    write_results(
        args.out,
        "copy_overlap",
        "A 4 KB host->GPU copy on the compute stream behind an adapter's copies on the load stream",
        "small_copy_behind_adapter_ms against small_copy_alone_ms and adapter_copy_ms (same run): "
        "a ratio near 1 in small_copy_delay_over_adapter_copy means the small copy waited for "
        "the whole adapter copy",
        list(rows[0]),
        rows,
    )


if __name__ == "__main__":
    main()
