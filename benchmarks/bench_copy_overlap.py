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


def host_issue(rank: int, slots: int = 3, repeats: int = 10) -> dict:
    """Host time of `LoraWeightPool.write` (Llama-3-8B shape) on the load stream: alone, and
    issued right after another adapter's write is queued there. The load path must never wait
    on the host for earlier copies; if it did, the engine's step loop would stall for a copy."""
    from benchmarks.bench_decode_step import LLAMA3_8B
    from replicas.adapters.loader import AdapterWeights
    from replicas.lora import LoraWeightPool

    pool = LoraWeightPool(LLAMA3_8B, slots, rank, torch.bfloat16, torch.device("cuda"), "triton")
    layers = tuple(torch.empty(pool._slot_bytes, dtype=torch.uint8).pin_memory()
                   for _ in range(LLAMA3_8B.num_layers))
    weights = [AdapterWeights(f"a{i}", rank, 2.0, {}, layers) for i in range(slots)]
    load = torch.cuda.Stream()

    def issue_ms(slot: int) -> float:
        t0 = time.perf_counter()
        pool.write(slot, weights[slot], stream=load)
        return 1000 * (time.perf_counter() - t0)

    alone, behind = [], []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        a = issue_ms(0)
        b = issue_ms(1 + i % (slots - 1))  # queued behind slot 0's copies
        if i >= 2:  # warm-up: the caching host allocator and the events
            alone.append(a)
            behind.append(b)
    torch.cuda.synchronize()
    copy_ms = _latency_ms(lambda done: (pool.write(0, weights[0], stream=load),
                                        done.record(load)))
    return {
        "adapter_MB": pool_mb(layers),
        "copy_ms": copy_ms,
        "host_issue_alone_ms": statistics.median(alone),
        "host_issue_behind_copy_ms": statistics.median(behind),
        "host_issue_behind_copy_max_ms": max(behind),
    }


def pool_mb(layers) -> float:
    return sum(t.numel() for t in layers) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sizes-mb", default="84,671")
    ap.add_argument("--host-issue-ranks", default="16,128",
                    help="also time LoraWeightPool.write on the host at these ranks")
    args = ap.parse_args()
    if args.host_issue_ranks:
        issue = [host_issue(int(r)) for r in args.host_issue_ranks.split(",")]
        for row in issue:
            print(row, flush=True)
        write_results(
            args.out,
            "copy_host_issue",
            "Host time to enqueue an adapter's write on the load stream, alone and behind "
            "another adapter's queued copy (Llama-3-8B shape)",
            "host_issue_behind_copy_ms against host_issue_alone_ms and copy_ms (same run): near "
            "copy_ms would mean the host waited for the earlier copy",
            list(issue[0]),
            issue,
        )
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
