"""Adapter churn on one GPU: many adapters over few slots, three loading modes, same workload.

    python benchmarks/bench_churn.py --num-adapters 32 --rank 16 --slots 8 --rate 4 \
        --popularity distinct,uniform,skewed --modes blocking,overlap,prefetch

The engine runs in-process (no HTTP) with a Llama-3-8B-shaped model of random bf16 weights, so
the numbers are the engine's own. Requests arrive by a seeded Poisson process; every mode sees
the same arrivals, prompts, lengths and adapters. Modes:
  blocking  (A) a request's adapter is copied while the step waits
  overlap   (B) disk reads and host->GPU copies overlap compute; nothing loads before it is needed
  prefetch  (C) as B, plus loads ahead of admission, pipelined per layer
`--resident` adds a reference run where every adapter fits in a slot and is loaded up front:
churn penalty = TTFT P50 (cold) / TTFT P50 (resident) at the same load.
Also measures host->GPU adapter copy bandwidth against a plain pinned copy of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import numpy as np
import torch

from benchmarks.common import dummy_fleet, write_results
from benchmarks.serve_engine import drive
from replicas.config import EngineConfig
from replicas.engine import Engine
from sim.calibrate import copy_bandwidth
from synthetic.presets import LLAMA3_8B, TINY
from workloads.churn import churn_requests
from workloads.requests import RequestSpec


def workload(args, names: list[str], kind: str):
    return churn_requests(
        names,
        kind,
        num_requests=args.num_requests,
        rate=args.rate,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )


def p_ms(seconds: list[float], q: float = 50) -> float:
    """The `q`th percentile of `seconds` in ms; 0 where there are none."""
    return 1000 * float(np.percentile(seconds, q)) if seconds else 0.0


def step_split(timings) -> dict:
    """Steps with prefill tokens, split by whether a layer waited on an adapter copy in flight:
    host launch time and whole step time (P50, ms). A gated step that is longer in its launch
    phase stalled on the host; one longer only in total waited on the device."""
    prefill = [t for t in timings if t.num_tokens > t.num_seqs]
    out = {}
    for label, group in (
        ("prefill", [t for t in prefill if not t.gated]),
        ("gated", [t for t in prefill if t.gated]),
    ):
        out[f"{label}_steps"] = len(group)
        out[f"{label}_launch_p50_ms"] = p_ms([t.launch_s for t in group])
        out[f"{label}_step_p50_ms"] = p_ms([t.total_s for t in group])
    return out


def run(engine: Engine, requests) -> dict:
    """`requests` ((arrival s, adapter, prompt, max tokens) each) through `serve_engine.drive`."""
    specs = [RequestSpec(i, adapter, False, tuple(prompt), len(prompt), n_out)
             for i, (_, adapter, prompt, n_out) in enumerate(requests)]  # fmt: skip
    result = drive(engine, specs, [r[0] for r in requests])
    timed = [(rec, req) for rec, req in zip(result.records, result.requests, strict=True)
             if rec.ok and req is not None]  # fmt: skip
    ttft = [rec.ttft_s for rec, _ in timed]
    itl = [gap for rec, _ in timed for gap in rec.itl_s]
    queued = [req.queue_s for _, req in timed if req.queue_s is not None]
    # admission -> first token: the admitting step (and any chunked prefill), apart from queueing
    admit = [req.arrival_time + rec.ttft_s - req.admitted_at
             for rec, req in timed if req.admitted_at is not None]  # fmt: skip
    tokens = sum(rec.output_tokens for rec in result.records)
    before, after = result.stats
    reads = after["adapter_disk_reads"] - before["adapter_disk_reads"]
    window = after["adapter_read_seconds"]
    read_seconds = window[len(window) - min(reads, len(window)) :]
    waits = result.adapter_waits
    return {
        "ttft_p50_ms": p_ms(ttft),
        # arrival -> admission: TTFT less this is the admitting step and any chunked prefill
        "queue_p50_ms": p_ms(queued),
        "admit_to_first_p50_ms": p_ms(admit),
        "ttft_p99_ms": p_ms(ttft, 99),
        "itl_p50_ms": p_ms(itl),
        "itl_p99_ms": p_ms(itl, 99),
        "e2e_p50_s": float(np.percentile([rec.e2e_s for rec, _ in timed], 50)),
        "throughput_tok_s": tokens / result.duration_s,
        "adapter_wait_mean_ms": 1000 * statistics.fmean(waits) if waits else 0.0,
        "gpu_loads": after["adapter_gpu_loads"] - before["adapter_gpu_loads"],
        "disk_reads": reads,
        "disk_read_mean_ms": 1000 * statistics.fmean(read_seconds) if read_seconds else 0.0,
        "prefetch_loads": after["adapter_prefetch_loads"] - before["adapter_prefetch_loads"],
        "requests": len(timed),
        # KV-cache pressure: requests sent back to wait and recomputed, and tokens per step
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "tokens_per_step": tokens / max(1, result.steps),
        **step_split(engine.step_timings(since_step=before["num_steps"])),
    }


def warm_up(engine: Engine, names: list[str], args) -> None:
    """Run every kernel shape the measured run will meet (a burst over all slots, then requests
    one at a time), so that Triton's compilation stays out of the figures (`run` counts only
    what happens during it)."""
    rng = random.Random(args.seed + 1)
    burst = min(64, 4 * args.slots)
    lengths = [
        args.input_len[0],
        args.input_len[1],
        *(rng.randint(*args.input_len) for _ in range(burst)),
    ]
    requests = [
        (
            0.0 if i < burst else 0.05 * (i - burst),
            names[i % len(names)],
            [rng.randrange(2, args.vocab_size) for _ in range(n)],
            4,
        )
        for i, n in enumerate(lengths + lengths[:8])
    ]
    run(engine, requests)


def parse_published(text: str | None) -> tuple[str, dict[str, float]] | None:
    """'SGLang:ttft_p50_ms=62.65,itl_p50_ms=22.68' -> ("SGLang", {"ttft_p50_ms": 62.65, ...})."""
    if not text:
        return None
    source, _, pairs = text.partition(":")
    figures = {}
    for pair in pairs.split(","):
        key, _, value = pair.partition("=")
        figures[key.strip()] = float(value)
    return source.strip(), figures


def save(args, rows: list[dict], copy: dict | None, kv_blocks: int | None) -> None:
    """Write the rows so far with their ratios to blocking (A) and to all-resident."""
    for kind in {r["popularity"] for r in rows}:
        base = {r["mode"]: r for r in rows if r["popularity"] == kind}
        for r in rows:
            if r["popularity"] != kind:
                continue
            if "blocking" in base:
                r["ttft_p50_vs_blocking"] = r["ttft_p50_ms"] / base["blocking"]["ttft_p50_ms"]
                r["throughput_vs_blocking"] = (
                    r["throughput_tok_s"] / base["blocking"]["throughput_tok_s"]
                )
            if "resident" in base:
                r["churn_penalty"] = r["ttft_p50_ms"] / base["resident"]["ttft_p50_ms"]
    published = parse_published(args.published)
    if published is not None:
        source, figures = published
        for r in rows:
            for key, value in figures.items():
                r[f"{key}_vs_{source}"] = r[key] / value
    name = args.name or f"churn_{args.num_adapters}x_r{args.rank}"
    cols = [
        "popularity",
        "mode",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "queue_p50_ms",
        "admit_to_first_p50_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "e2e_p50_s",
        "throughput_tok_s",
        "adapter_wait_mean_ms",
        "gpu_loads",
        "prefetch_loads",
        "disk_reads",
        "disk_read_mean_ms",
        "preemptions",
        "tokens_per_step",
        "prefill_launch_p50_ms",
        "prefill_step_p50_ms",
        "gated_steps",
        "gated_launch_p50_ms",
        "gated_step_p50_ms",
        "ttft_p50_vs_blocking",
        "throughput_vs_blocking",
        "churn_penalty",
    ]
    if published is not None:
        cols += [f"{key}_vs_{published[0]}" for key in published[1]]
    write_results(
        args.out,
        name,
        f"Adapter churn: {args.num_adapters} rank-{args.rank} adapters over {args.slots} slots, "
        f"Poisson {args.rate} req/s",
        "modes against blocking loads (A) in the same run; churn penalty against all-resident",
        cols,
        rows,
        {
            "copy_bandwidth": copy,
            "kv_blocks": kv_blocks,
            "published": args.published,
            "args": {k: str(v) for k, v in vars(args).items()},
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--input-len", type=lambda s: tuple(map(int, s.split(":"))), default=(128, 512))
    ap.add_argument("--output-len", type=lambda s: tuple(map(int, s.split(":"))), default=(32, 96))
    ap.add_argument("--popularity", default="distinct,uniform,skewed")
    ap.add_argument("--modes", default="blocking,overlap,prefetch")
    ap.add_argument("--resident", action="store_true")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=4096,
        help="KV cache blocks of 16 tokens; 0 sizes the cache from free GPU memory as a served "
        "engine does (kv_cache_memory_fraction)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--kv-reserve-ratios",
        default=None,
        help="comma-separated engine kv_reserve_ratio values, each a configuration of its own "
        "(e.g. 0,0.5: no KV headroom against the default); default: the engine's",
    )
    ap.add_argument(
        "--host-cache",
        type=int,
        default=None,
        help="adapters held in host memory (default: all, read before the run, so the run "
        "measures slot churn alone); fewer brings disk reads into the churn",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU; checks the code")
    ap.add_argument(
        "--published",
        default=None,
        help="figures published elsewhere for this shape, e.g. 'SGLang:ttft_p50_ms=62.65,"
        "itl_p50_ms=22.68': each row gets its ratio to them",
    )
    args = ap.parse_args()
    model_config = TINY if args.smoke else LLAMA3_8B
    args.vocab_size = model_config["vocab_size"]
    device = "cpu" if args.smoke else "cuda"
    names = [f"lora-{i}" for i in range(args.num_adapters)]
    model, fleet = dummy_fleet("churn-", model_config, names, args.rank)

    host_cache = args.host_cache or args.num_adapters

    def engine(mode: str, slots: int, reserve: float | None) -> Engine:
        extra = {} if reserve is None else {"kv_reserve_ratio": reserve}
        return Engine(
            EngineConfig(
                **extra,
                model=str(model),
                load_format="dummy",
                device=device,
                max_loras_per_batch=slots,
                max_lora_rank=args.rank,
                max_loaded_loras=max(host_cache, slots),
                adapters=tuple(fleet.items()),
                adapter_loading=mode,
                num_kv_blocks=args.kv_blocks or None,
                max_num_seqs=args.max_num_seqs,
                max_model_len=2048,
            )
        )

    kinds = args.popularity.split(",")
    reserves = (
        [float(r) for r in args.kv_reserve_ratios.split(",")] if args.kv_reserve_ratios else [None]
    )
    configs = [(m, args.slots, r) for m in args.modes.split(",") for r in reserves]
    if args.resident:
        configs.append(("resident", args.num_adapters, None))
    rows, copy = [], None
    # One engine per configuration, reused across popularities: a build captures a graph set
    # and compiles kernels for its slot count, which takes longer than a measured run.
    for mode, slots, reserve in configs:
        built = time.monotonic()
        e = engine("prefetch" if mode == "resident" else mode, slots, reserve)
        if reserve is not None:
            mode = f"{mode}@kv_reserve={reserve:g}"
        print(f"engine for {mode} built in {time.monotonic() - built:.1f} s", flush=True)
        # With room for every adapter in host memory, all are read first: the run measures
        # slot churn alone. With less, disk reads are part of the churn.
        for name in names if host_cache >= args.num_adapters or mode == "resident" else []:
            e.preload_adapter(name)
        if mode == "resident":
            for name in names:
                e.preload_adapter(name, into_slot=True)
            if device == "cuda":
                torch.cuda.synchronize()
        if copy is None and device == "cuda":
            copy = copy_bandwidth(e, names[0])
            print("copy", copy, flush=True)
        for kind in kinds:
            started = time.monotonic()
            warm_up(e, names, args)
            result = run(e, workload(args, names, kind))
            row = {"popularity": kind, "mode": mode, **result}
            rows.append(row)
            rows.sort(key=lambda r: kinds.index(r["popularity"]))  # stable: modes stay in order
            print(f"{kind}/{mode} in {time.monotonic() - started:.1f} s:", row, flush=True)
            # after every run: a cut-off benchmark keeps what it measured
            save(args, rows, copy, e.runner.num_kv_blocks)
        e.shutdown()
        del e
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
