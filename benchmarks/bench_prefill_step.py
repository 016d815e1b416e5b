"""Prefill-step time of the engine on a Llama-3-8B-shaped model (random bf16 weights), against
the compute floor measured in the same run.

    python -m benchmarks.bench_prefill_step [--tokens 128,512,2048] [--profile] [--out DIR]

One request of N prompt tokens (on a rank-16 adapter over all seven projections, or on the base
model) enters an idle engine, and `engine.step()` is timed from call to return: the step reads
its sampled token back, so this is the whole prefill as a request's TTFT sees it, host work
included. Floor: 2 x parameters x N FLOPs at the bf16 matmul rate of a large square GEMM timed
here, or the weights' bytes over the HBM bandwidth timed here, whichever is larger.
`--profile` also writes, per case, the
GPU time per kernel and the host time per op of one step (prefill_profile_<tokens>_<adapter>.txt),
and reports the step's summed kernel time (`gpu_busy_ms`): far below `step_ms` means the step is
bound by host work, not by kernels. Steps of up to `max_prefill_graph_tokens` replay per-layer
CUDA graphs; each such case is timed eagerly too, in the same run (`eager_ms`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import dummy_fleet, hbm_bandwidth, time_cuda, write_results
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from synthetic.presets import LLAMA3_8B, TINY


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n GEMM."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    us = time_cuda(lambda: a @ b, iters=10, repeats=5)
    return 2 * n**3 / (us * 1e-6)


def prefill_once(engine: Engine, tokens: int, adapter: str | None, rng: random.Random) -> float:
    """Seconds of the step that prefills one fresh request of `tokens` prompt tokens."""
    prompt = [rng.randrange(2, engine.spec.vocab_size) for _ in range(tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    request = Request(f"p{rng.random()}", prompt, params, adapter)
    engine.add_request(request)
    started = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - started
    if engine.has_work or not any(o.new_token_ids for o in outputs):
        raise RuntimeError(f"a {tokens}-token prompt did not prefill in one step")
    return elapsed


def profile_step(engine, tokens: int, adapter: str | None, rng, out: Path) -> float | None:
    """Profile one step into a text file; returns the GPU time its kernels took (ms), which
    against the step's wall time tells a host-bound step from slow kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        prefill_once(engine, tokens, adapter, rng)
    averages = prof.key_averages()
    text = []
    if torch.cuda.is_available():
        text.append(
            averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
        )
    text.append(
        averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    )
    out.mkdir(parents=True, exist_ok=True)
    name = f"prefill_profile_{tokens}_{adapter or 'base'}.txt"
    (out / name).write_text("\n\n".join(text))
    print(text[0][:4000], flush=True)
    if not torch.cuda.is_available():
        return None
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in kernels) / 1000  # the kernels' own rows only


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU; checks the code")
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    config = TINY if args.smoke else LLAMA3_8B
    device = "cpu" if args.smoke else "cuda"
    model, fleet = dummy_fleet("prefill-", config, ["lora-0"], args.rank)
    engine = Engine(
        EngineConfig(
            model=str(model),
            load_format="dummy",
            device=device,
            max_loras_per_batch=1,
            max_lora_rank=args.rank,
            adapters=tuple(fleet.items()),
            num_kv_blocks=2 * (max(sizes) // 16 + 2),
            max_num_seqs=8,
            max_num_batched_tokens=max(sizes),
            max_model_len=max(sizes) + 16,
        )
    )
    params = sum(p.numel() for p in engine.runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    rate = bandwidth = None
    if device == "cuda":
        rate, bandwidth = matmul_rate(), hbm_bandwidth()
    engine.preload_adapter("lora-0", into_slot=True)  # in its slot before any step is timed
    rng = random.Random(0)
    rows = []
    for tokens in sizes:
        for adapter in (None, "lora-0"):
            for _ in range(2):  # first use of a shape: kernels compile
                prefill_once(engine, tokens, adapter, rng)
            seconds = [prefill_once(engine, tokens, adapter, rng) for _ in range(args.repeats)]
            step_ms = 1000 * statistics.median(seconds)
            row = {
                "tokens": tokens,
                "adapter": f"rank {args.rank}" if adapter else "none",
                "step_ms": step_ms,
                "tokens_per_s": tokens / (step_ms / 1000),
            }
            graphs = engine.runner.prefill_graphs
            if graphs is not None and graphs.bucket_for(tokens):  # the same step run eagerly
                engine.runner.prefill_graphs = None
                prefill_once(engine, tokens, adapter, rng)  # first eager use: kernels compile
                eager = [prefill_once(engine, tokens, adapter, rng) for _ in range(args.repeats)]
                engine.runner.prefill_graphs = graphs
                row["eager_ms"] = 1000 * statistics.median(eager)
                row["eager_vs_graphs"] = row["eager_ms"] / step_ms
            if rate is not None:
                floor_ms = 1000 * max(2 * params * tokens / rate, weight_bytes / bandwidth)
                row.update(floor_ms=floor_ms, ratio_to_floor=step_ms / floor_ms)
            if args.profile:
                row["gpu_busy_ms"] = profile_step(engine, tokens, adapter, rng, Path(args.out))
            rows.append(row)
            print(row, flush=True)
    write_results(
        args.out,
        "prefill_step",
        "Prefill step, one request, Llama-3-8B shape"
        + (" (smoke: tiny model, CPU)" if args.smoke else ""),
        "step time against max(2 x params x tokens / measured bf16 GEMM rate, weight bytes / "
        "measured HBM bandwidth); graph-replayed steps against the same step run eagerly",
        [
            "tokens",
            "adapter",
            "step_ms",
            "gpu_busy_ms",
            "floor_ms",
            "ratio_to_floor",
            "tokens_per_s",
            "eager_ms",
            "eager_vs_graphs",
        ],
        rows,
        {
            "gemm_TFLOPs": rate and rate / 1e12,
            "hbm_TBps": bandwidth and bandwidth / 1e12,
            "params": params,
        },
    )


if __name__ == "__main__":
    main()
