"""Decode-step time of a Llama-3-8B-shaped model (random bf16 weights: the same FLOPs and bytes
as the real one) on one GPU, against the memory floor measured in the same run.

    python benchmarks/bench_decode_step.py [--batch 64] [--context 1024] [--out benchmarks/results]

Cases: base model only, and every sequence on its own rank-16 adapter over all seven
projections; each with CUDA graphs (Triton kernels) and eager. Floor = (base weights + the
adapters' weights + the KV cache read) / HBM bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import hbm_bandwidth, time_cuda, write_results
from kernels.attention import AttentionBatch, get_attention_backend
from kernels.layer_ops import get_layer_ops
from replicas.cuda_graphs import DecodeGraphs
from replicas.flat_step import FlatStep
from replicas.kv_cache import blocks_for
from replicas.lora import LORA_GROUPS, LoraWeightPool
from replicas.models.llama import StepContext
from replicas.models.spec import ModelSpec
from replicas.models.weights import random_model
from replicas.staging import HostStaging
from synthetic import presets

LLAMA3_8B = ModelSpec.from_dict(presets.LLAMA3_8B)


def fill_adapters(pool: LoraWeightPool, rank: int) -> None:
    for layer in range(pool.spec.num_layers):
        for group, targets in LORA_GROUPS.items():
            a, b = pool.a[layer][group], pool.b[layer][group]
            for i in range(len(targets)):
                a[:, i * pool.max_rank : i * pool.max_rank + rank].normal_(0, 0.02)
            b[:, :rank].normal_(0, 0.02)
    pool.ranks.fill_(rank)
    pool.scalings.fill_(2.0)
    pool.ranks_host[:] = [rank] * pool.num_slots
    pool.scalings_host[:] = [2.0] * pool.num_slots


def adapter_bytes(spec: ModelSpec, rank: int, n: int) -> int:
    per = sum(rank * sum(spec.lora_dims(t)) for ts in LORA_GROUPS.values() for t in ts)
    return 2 * per * spec.num_layers * n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--triton-only", action="store_true", help="skip the torch-attention rows")
    args = ap.parse_args()
    spec, B, ctx, bs = LLAMA3_8B, args.batch, args.context, 16
    torch.manual_seed(0)
    model = random_model(
        spec, torch.bfloat16, torch.device("cuda"), ctx + 16, ops=get_layer_ops("triton")
    )
    pool = LoraWeightPool(spec, B, args.rank, torch.bfloat16, torch.device("cuda"), "triton")
    fill_adapters(pool, args.rank)
    per_seq = blocks_for(ctx + 1, bs)
    num_blocks = B * per_seq
    kv = []  # per layer, K and V alike
    for _ in range(spec.num_layers):
        shape = (num_blocks + 1, bs, spec.num_kv_heads, spec.head_dim)
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.1
        kv.append((k, k.clone()))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
    ids = [7] * B
    positions = [ctx - 1] * B
    slot_mapping = [tables[i][(ctx - 1) // bs] * bs + (ctx - 1) % bs for i in range(B)]
    ctx_lens = [ctx] * B
    stage = HostStaging(torch.device("cuda"))
    bw = hbm_bandwidth()
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_read = 2 * spec.num_layers * B * ctx * spec.num_kv_heads * spec.head_dim * 2
    rows = []
    for attention_name in ("triton",) if args.triton_only else ("triton", "torch"):
        attention = get_attention_backend(attention_name)
        graphs = None
        if attention_name == "triton":
            graphs = DecodeGraphs(
                model, pool, kv, attention, B, per_seq, bs, num_blocks * bs, torch.device("cuda")
            )
            graphs.capture()
        for with_adapters in (False, True):
            seg_lens = [1] * B if with_adapters else []
            seg_slots = list(range(B)) if with_adapters else []

            def eager(seg_lens=seg_lens, seg_slots=seg_slots, attention=attention):
                stage.reset()
                attn = AttentionBatch(
                    q_starts=list(range(B + 1)),
                    ctx_lens=ctx_lens,
                    slot_mapping=stage.tensor(slot_mapping, torch.int64),
                    block_table=stage.tensor(tables, torch.int32),
                    ctx_lens_t=stage.tensor(ctx_lens, torch.int32),
                    q_starts_t=stage.tensor(list(range(B + 1)), torch.int32),
                    block_size=bs,
                )
                lora = pool.make_batch(seg_lens, seg_slots, B, stage.tensor)
                c = StepContext(attn, lora, kv, pool, attention)
                with torch.inference_mode():
                    h = model(
                        stage.tensor(ids, torch.int64), stage.tensor(positions, torch.int64), c
                    )
                    return model.logits(h)

            def graphed(seg_lens=seg_lens, seg_slots=seg_slots, graphs=graphs):
                stage.reset()
                with torch.inference_mode():
                    step = FlatStep(
                        ids,
                        positions,
                        slot_mapping,
                        list(range(B + 1)),
                        ctx_lens,
                        tables,
                        seg_lens,
                        seg_slots,
                    )
                    h = graphs.run(stage, step)
                    return model.logits(h)

            floor_bytes = (
                base_bytes + kv_read + (adapter_bytes(spec, args.rank, B) if with_adapters else 0)
            )
            floor_us = floor_bytes / bw * 1e6
            modes = [("eager", eager)] + ([("cuda graph", graphed)] if graphs else [])
            for mode, fn in modes:
                us = time_cuda(fn, iters=10, repeats=5, warmup=3)
                rows.append(
                    {
                        "attention": attention_name,
                        "mode": mode,
                        "adapters": f"{B} x rank {args.rank}" if with_adapters else "none",
                        "step_ms": us / 1000,
                        "floor_ms": floor_us / 1000,
                        "ratio_to_floor": us / floor_us,
                    }
                )
                print(rows[-1], flush=True)
    write_results(
        args.out,
        "decode_step",
        f"Decode step, Llama-3-8B shape, batch {B}, context {ctx}",
        "step time / floor; floor = (base weights + adapter weights + KV read) / HBM bandwidth",
        ["attention", "mode", "adapters", "step_ms", "floor_ms", "ratio_to_floor"],
        rows,
        {"hbm_bandwidth_TBps": bw / 1e12, "batch": B, "context": ctx},
    )


if __name__ == "__main__":
    main()
