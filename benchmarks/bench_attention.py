"""Paged decode attention at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16,
block 16) under CUDA-graph replay, against the memory floor and the torch reference.

    python -m benchmarks.bench_attention [--batch 64] [--contexts 1024 4096] [--out DIR]
    python -m benchmarks.bench_attention --smoke     # tiny sizes on CPU, Triton's interpreter

Floor = KV bytes read (B x context x Hkv x D x 2 tensors x 2 bytes) / HBM bandwidth, the bandwidth
measured in the same run by a large device-to-device copy (read + write). Each graph runs the
layer over several distinct caches in turn, so no layer's cache is still in L2 when it is read.
Blocks are shuffled across sequences, as after churn. Cases: every sequence at each context, with
a tight block table and one as wide as max_model_len (the engine's graph shape); and one straggler
at max_model_len among sequences at the first context, the case split-K is for.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from synthetic import presets


def attention_shape(config: dict, block_size: int) -> dict:
    """Query heads, KV heads and head size of a model's config.json, with a KV block size."""
    return dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        block_size=block_size,
    )


LLAMA3_8B = attention_shape(presets.LLAMA3_8B, block_size=16)
TINY = attention_shape(presets.TINY, block_size=4)


@dataclass
class Layers:
    """`count` layers' caches and one decode step's inputs and metadata, shared by the layers."""

    q: torch.Tensor  # [B, Hq, D]
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [num_blocks, bs, Hkv, D] x 2
    block_table: torch.Tensor  # [B, width] int32
    ctx_lens: list[int]
    batch: object  # AttentionBatch

    @property
    def kv_bytes_per_layer(self) -> int:
        k = self.caches[0][0]
        return 2 * sum(self.ctx_lens) * k.shape[2] * k.shape[3] * k.element_size()


def make_layers(
    ctx_lens: list[int],
    width: int,
    count: int,
    shape: dict,
    dtype: torch.dtype,
    device: torch.device,
) -> Layers:
    from kernels.attention import AttentionBatch

    bs, hkv, d = shape["block_size"], shape["num_kv_heads"], shape["head_dim"]
    per_seq = [-(-ctx // bs) for ctx in ctx_lens]
    assert width >= max(per_seq)
    num_blocks = sum(per_seq)
    order = torch.randperm(num_blocks, dtype=torch.int64).to(torch.int32)
    table = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    for i, used in enumerate(torch.tensor([0] + per_seq).cumsum(0)[:-1].tolist()):
        table[i, : per_seq[i]] = order[used : used + per_seq[i]]
    caches = [
        tuple(torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype) for _ in range(2))
        for _ in range(count)
    ]
    batch = len(ctx_lens)
    q = torch.randn(batch, shape["num_heads"], d, device=device, dtype=dtype)
    attn = AttentionBatch(
        q_starts=list(range(batch + 1)),
        ctx_lens=ctx_lens,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),  # unused: no store
        block_table=table.to(device),
        ctx_lens_t=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        q_starts_t=torch.arange(batch + 1, dtype=torch.int32, device=device),
        block_size=bs,
    )
    return Layers(q, caches, attn.block_table, ctx_lens, attn)


def graph_us_per_layer(layers: Layers, attend: Callable) -> float:
    """Capture one call per layer cache into a CUDA graph; µs per layer over its replays.
    `attend(q, k_cache, v_cache, out)` writes out."""
    from benchmarks.common import graph_replay_us

    outs = [torch.empty_like(layers.q) for _ in layers.caches]

    def step():
        for (k, v), out in zip(layers.caches, outs, strict=True):
            attend(layers.q, k, v, out)

    return graph_replay_us(step) / len(layers.caches)


class TritonDecode:
    """The Triton decode kernel over `layers`' metadata: (q, k, v, out=None) -> out; `kw` go to
    the kernel (e.g. `tiling`)."""

    def __init__(self, layers: Layers, **kw) -> None:
        from kernels.attention_triton import paged_decode_attention

        self.fn, self.layers, self.kw = paged_decode_attention, layers, kw

    def __call__(self, q, k, v, out=None):
        lay = self.layers
        return self.fn(
            q, k, v, lay.block_table, lay.batch.ctx_lens_t, q.shape[-1] ** -0.5, out=out, **self.kw
        )


class TorchReference:
    """torch_paged_attention over `layers`' metadata: (q, k, v, out=None) -> out."""

    def __init__(self, layers: Layers) -> None:
        from kernels.attention import torch_paged_attention

        self.fn, self.layers = torch_paged_attention, layers

    def __call__(self, q, k, v, out=None):
        result = self.fn(q, k, v, self.layers.batch, q.shape[-1] ** -0.5)
        return result if out is None else out.copy_(result)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_gpu(args: argparse.Namespace) -> None:
    from benchmarks.common import hbm_bandwidth, write_results

    torch.manual_seed(0)
    bw = hbm_bandwidth()
    print(f"HBM copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    bs = LLAMA3_8B["block_size"]
    full_width = -(-args.max_model_len // bs)
    rows = []
    for context in args.contexts:
        tight = -(-context // bs)
        for width in sorted({tight, full_width}):
            rows.append(measure([context] * args.batch, width, bw, args, with_torch=width == tight))
    # One sequence at max_model_len among short ones: the straggler split-K is for.
    straggler = [args.contexts[0]] * (args.batch - 1) + [args.max_model_len]
    rows.append(measure(straggler, full_width, bw, args, with_torch=False))
    path = write_results(
        args.out,
        "attention",
        f"Paged decode attention, Llama-3-8B shapes (32/8 heads, D 128, bf16, block 16), "
        f"batch {args.batch}",
        "µs per layer under CUDA-graph replay / floor; floor = KV bytes read / HBM bandwidth; "
        f"table_width {full_width} is the engine's graph shape for max_model_len "
        f"{args.max_model_len}",
        [
            "context",
            "table_width",
            "grid",
            "triton_us",
            "floor_us",
            "ratio_to_floor",
            "torch_us",
            "torch_mode",
            "speedup_vs_torch",
        ],
        rows,
        {
            "hbm_bandwidth_TBps": round(bw / 1e12, 3),
            "batch": args.batch,
            "layers_rotated": args.layers,
        },
    )
    print(f"wrote {path}")


def measure(
    ctx_lens: list[int], width: int, bw: float, args: argparse.Namespace, with_torch: bool
) -> dict:
    from kernels.attention_triton import decode_max_extra

    device = torch.device("cuda")
    layers = make_layers(ctx_lens, width, args.layers, LLAMA3_8B, torch.bfloat16, device)
    floor_us = layers.kv_bytes_per_layer / bw * 1e6
    hkv = LLAMA3_8B["num_kv_heads"]
    extra = decode_max_extra(len(ctx_lens), hkv, width * LLAMA3_8B["block_size"], device)
    triton_fn = TritonDecode(layers)
    k, v = layers.caches[0]
    err = relative_error(triton_fn(layers.q, k, v), TorchReference(layers)(layers.q, k, v))
    assert err < 1e-2, f"triton decode differs from the reference: {err:.2e}"
    us = graph_us_per_layer(layers, triton_fn)
    uniform = len(set(ctx_lens)) == 1
    row = {
        "context": ctx_lens[0]
        if uniform
        else f"{len(ctx_lens) - 1} x {ctx_lens[0]} + 1 x {ctx_lens[-1]}",
        "table_width": width,
        "grid": f"({len(ctx_lens)} + {extra}) x {hkv}",
        "triton_us": us,
        "floor_us": floor_us,
        "ratio_to_floor": us / floor_us,
        "rel_err": err,
    }
    if with_torch:
        row["torch_us"], row["torch_mode"] = time_reference(layers)
        row["speedup_vs_torch"] = row["torch_us"] / us
    print(row, flush=True)
    del layers, triton_fn
    torch.cuda.empty_cache()
    return row


def time_reference(layers: Layers) -> tuple[float, str]:
    """The torch reference under graph replay where it captures, else eager."""
    from benchmarks.common import time_cuda

    ref = TorchReference(layers)
    try:
        return graph_us_per_layer(layers, ref), "cuda graph"
    except RuntimeError as e:  # not capturable: time it eagerly
        print(f"torch reference did not capture ({e}); timing it eagerly", flush=True)
        torch.cuda.synchronize()
        k, v = layers.caches[0]
        return time_cuda(lambda: ref(layers.q, k, v), iters=5, repeats=3, warmup=1), "eager"


def run_smoke(args: argparse.Namespace) -> None:
    """Tiny sizes on CPU through the interpreter: checks the kernel against the reference and
    that the benchmark's plumbing runs; the times say nothing about a GPU."""
    from kernels.attention_triton import DecodeTiling

    tiling = DecodeTiling(block_n=16, programs_per_sm=16, min_split_tokens=8)  # several splits
    torch.manual_seed(0)
    rows = []
    for context in (8, 20):
        layers = make_layers([context, 3], 8, 1, TINY, torch.float32, torch.device("cpu"))
        k, v = layers.caches[0]
        ref = TorchReference(layers)(layers.q, k, v)
        start = time.perf_counter()
        out = TritonDecode(layers, tiling=tiling)(layers.q, k, v)
        ms = (time.perf_counter() - start) * 1e3
        err = relative_error(out, ref)
        assert err < 1e-5, f"triton decode differs from the reference: {err:.2e}"
        rows.append({"context": context, "interpreter_ms": ms, "rel_err": err})
        print(rows[-1], flush=True)
    if args.out:
        from benchmarks.common import write_results

        write_results(
            args.out,
            "attention_smoke",
            "Paged decode attention, smoke (CPU, Triton interpreter)",
            "correctness only",
            ["context", "interpreter_ms", "rel_err"],
            rows,
        )


def main() -> None:
    from benchmarks.common import run_smoke_or_gpu, smoke_or_gpu_parser

    ap = smoke_or_gpu_parser(__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="also time a block table as wide as this (the engine's graph shape)",
    )
    ap.add_argument("--layers", type=int, default=4, help="distinct caches rotated per replay")
    run_smoke_or_gpu(ap.parse_args(), run_smoke, run_gpu)


if __name__ == "__main__":
    main()
