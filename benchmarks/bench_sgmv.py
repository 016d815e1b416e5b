"""SGMV LoRA deltas of one Llama-3-8B layer (all seven projections) under CUDA-graph replay,
against the memory floor and a torch gather-bmm baseline.

    python -m benchmarks.bench_sgmv [--out DIR] [--only decode|prefill] [--breakdown]
    python -m benchmarks.bench_sgmv --quick    # only the cases behind the design targets
    python -m benchmarks.bench_sgmv --sweep    # time candidate tilings per group; writes nothing
    python -m benchmarks.bench_sgmv --smoke     # tiny sizes on CPU, Triton's interpreter

A layer is four shrink + expand pairs: fused q/k/v (4096 -> 4096 + 1024 + 1024), o (4096 -> 4096),
fused gate/up (4096 -> 2 x 14336) and down (14336 -> 4096), bf16. Tokens are grouped by adapter
(B tokens over D distinct adapters, B/D tokens each). The pool's max rank is the largest rank in
the case; every adapter costs its own rank.

Floor = minimal bytes / HBM bandwidth, the bandwidth measured in the same run by a large
device-to-device copy (read + write). Minimal bytes = each distinct adapter's A and B at its true
rank, once, plus activations: x read, y read and written. Each graph runs the seven projections
over several layers' weights in turn (enough to overflow L2), so weights come from HBM.

The baseline gathers every token's A and B at the pool's max rank (A[slot_of_token],
B[slot_of_token]) and multiplies with torch.bmm, captured in a CUDA graph as well.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time
from dataclasses import dataclass

import torch

# group -> (input width, output widths of the fused slices)
LLAMA3_8B = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
TINY = {"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))}
MIXED_RANKS = (8, 16, 32, 64)
L2_MULTIPLE = 4  # rotate enough layers that their weights are this many times the L2 size
MAX_LAYERS = 128


@dataclass(frozen=True)
class Case:
    phase: str  # "decode" or "prefill"
    seg_lens: tuple[int, ...]  # tokens per distinct adapter
    ranks: tuple[int, ...]  # true rank per distinct adapter
    rank_label: str

    @property
    def num_tokens(self) -> int:
        return sum(self.seg_lens)

    @property
    def num_adapters(self) -> int:
        return len(self.seg_lens)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)


# A skewed decode batch: a few popular adapters with several requests each beside many with one
SKEWED_SEGMENTS = (16, 8, 4, 4, 2, 2, 2, 2) + (1,) * 24
SKEWED = Case("decode", SKEWED_SEGMENTS, (16,) * 32, "16")
SKEWED_MIXED = Case("decode", SKEWED_SEGMENTS, tuple(MIXED_RANKS[i % 4] for i in range(32)),
                    "mixed")


def cases(only: str | None) -> list[Case]:
    out = []
    rank_sets = [(str(r), lambda d, r=r: (r,) * d) for r in (8, 16, 64)]
    rank_sets.append(("mixed", lambda d: tuple(MIXED_RANKS[i % 4] for i in range(d))))
    if only in (None, "decode"):
        for b in (1, 8, 32, 64, 128):
            for d in sorted({1, 8, b} & set(range(1, b + 1))):
                for label, ranks in rank_sets:
                    out.append(Case("decode", (b // d,) * d, ranks(d), label))
        out += [SKEWED, SKEWED_MIXED]  # 64 tokens over 32 adapters, segments of 16 down to 1
    if only in (None, "prefill"):
        for label, ranks in rank_sets[1:2] + rank_sets[3:]:
            out.append(Case("prefill", (512,) * 4, ranks(4), label))
    return out


def minimal_bytes(case: Case, shapes: dict, elem: int = 2) -> int:
    total = 0
    for d_in, outs in shapes.values():
        n, d_out = len(outs), sum(outs)
        total += sum((n * r * d_in + d_out * r) * elem for r in case.ranks)  # weights, true rank
        total += case.num_tokens * (d_in + 2 * d_out) * elem  # x in, y in and out
    return total


@dataclass
class Problem:
    """`layers` copies of every group's weights, one step's activations and batch metadata."""

    case: Case
    shapes: dict
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: group -> (A, B)
    x: dict[str, torch.Tensor]  # group -> [T, d_in]
    y: dict[str, torch.Tensor]  # group -> [T, d_out]
    batch: object  # SgmvBatch
    token_slots: torch.Tensor  # [T] int64, for the baseline
    token_scale: torch.Tensor  # [T, 1] for the baseline
    h: dict[str, torch.Tensor] | None = None  # group -> shrink output, for timing the expand

    def offsets(self, group: str) -> tuple[int, ...]:
        offsets = [0]
        for w in self.shapes[group][1]:
            offsets.append(offsets[-1] + w)
        return tuple(offsets)


def make_problem(case: Case, shapes: dict, layers: int, dtype, device) -> Problem:
    from kernels.sgmv import SgmvBatch

    num_slots, max_rank = case.num_adapters, case.max_rank
    weights = []
    for _ in range(layers):
        layer = {}
        for group, (d_in, outs) in shapes.items():
            n = len(outs)
            a = torch.randn(num_slots, n * max_rank, d_in, device=device, dtype=dtype) * 0.02
            b = torch.randn(num_slots, max_rank, sum(outs), device=device, dtype=dtype) * 0.02
            for slot, r in enumerate(case.ranks):  # the contract: zero past the true rank
                a.view(num_slots, n, max_rank, d_in)[slot, :, r:] = 0
                b[slot, r:] = 0
            layer[group] = (a, b)
        weights.append(layer)
    t = case.num_tokens
    x = {g: torch.randn(t, d_in, device=device, dtype=dtype) for g, (d_in, _) in shapes.items()}
    y = {g: torch.randn(t, sum(o), device=device, dtype=dtype) for g, (_, o) in shapes.items()}
    ends = torch.tensor(case.seg_lens).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    slots = list(range(num_slots))
    scalings = [2.0 / r for r in case.ranks]
    i32 = dict(dtype=torch.int32, device=device)
    batch = SgmvBatch(
        seg_starts=starts,
        seg_ends=ends,
        seg_slots_host=slots,
        seg_indptr=torch.tensor([0, *ends], **i32),
        seg_slots=torch.tensor(slots, **i32),
        slot_ranks=torch.tensor(case.ranks, **i32),
        slot_scalings=torch.tensor(scalings, dtype=torch.float32, device=device),
        slot_ranks_host=case.ranks,
        slot_scalings_host=tuple(scalings),
        num_tokens=t,
    )
    token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(case.seg_lens))
    token_scale = torch.tensor(scalings)[token_slots].to(device, dtype)[:, None]
    return Problem(case, shapes, weights, x, y, batch, token_slots.to(device), token_scale)


def sgmv_layer(p: Problem, layer: int, groups=None) -> None:
    from kernels.sgmv import get_backend

    triton = get_backend("triton")
    for group in groups or p.shapes:
        a, b = p.weights[layer][group]
        triton.apply(p.x[group], a, b, p.batch, p.y[group], p.offsets(group))


def shrink_layer(p: Problem, layer: int, groups=None) -> None:
    from kernels.sgmv_triton import triton_shrink

    for group in groups or p.shapes:
        triton_shrink(p.x[group], p.weights[layer][group][0], p.batch, len(p.shapes[group][1]))


def layer0_h(p: Problem) -> dict:
    """Each group's h from layer 0's A: the input `expand_layer` reads."""
    from kernels.sgmv_triton import triton_shrink

    return {g: triton_shrink(p.x[g], p.weights[0][g][0], p.batch, len(p.shapes[g][1]))
            for g in p.shapes}


def expand_layer(p: Problem, layer: int, groups=None) -> None:
    from kernels.sgmv_triton import triton_expand

    for group in groups or p.shapes:
        h = p.h[group]
        triton_expand(h, p.weights[layer][group][1], p.batch, p.y[group], p.offsets(group))


def gather_bmm_layer(p: Problem, layer: int, groups=None) -> None:
    """Per-token gather of the weights at the pool's max rank, then two batched products."""
    for group in groups or p.shapes:
        a, b = p.weights[layer][group]
        n, max_rank = len(p.shapes[group][1]), b.shape[1]
        h = torch.bmm(a[p.token_slots], p.x[group][:, :, None])  # [T, n*R, 1]
        b_tok = b[p.token_slots].transpose(1, 2)  # [T, d_out, R] (a transposed view)
        offsets = p.offsets(group)
        for i in range(n):
            o0, o1 = offsets[i], offsets[i + 1]
            delta = torch.bmm(b_tok[:, o0:o1], h[:, i * max_rank : (i + 1) * max_rank])
            p.y[group][:, o0:o1] += p.token_scale * delta[:, :, 0]


def graph_us_per_layer(p: Problem, layer_fn, groups=None, iters: int = 20) -> float:
    """Capture `layer_fn` over every layer into one CUDA graph; µs per layer over its replays
    (the run before the capture also grows the split-K counters)."""
    from benchmarks.common import graph_replay_us

    def step():
        for layer in range(len(p.weights)):
            layer_fn(p, layer, groups)

    return graph_replay_us(step, iters) / len(p.weights)


def check_against_reference(p: Problem) -> float:
    """Largest relative error of the Triton delta vs the torch reference (float32), layer 0."""
    from kernels.sgmv import get_backend, torch_expand, torch_shrink

    worst = 0.0
    for group, (_, outs) in p.shapes.items():
        a, b = p.weights[0][group]
        x = p.x[group]
        y = torch.zeros_like(p.y[group])
        get_backend("triton").apply(x, a, b, p.batch, y, p.offsets(group))
        y_ref = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        h_ref = torch_shrink(x.float(), a.float(), p.batch, len(outs))
        torch_expand(h_ref, b.float(), p.batch, y_ref, p.offsets(group))
        err = ((y.float() - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst


def weight_bytes(case: Case, shapes: dict) -> int:
    """A layer's adapter weights at each adapter's true rank (minimal bytes less x and y)."""
    no_weights = Case(case.phase, case.seg_lens, (0,) * case.num_adapters, "")
    return minimal_bytes(case, shapes) - minimal_bytes(no_weights, shapes)


def layers_for(case: Case, shapes: dict, device) -> int:
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(2, min(MAX_LAYERS, math.ceil(L2_MULTIPLE * l2 / weight_bytes(case, shapes))))


def measure(case: Case, bw: float, args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    layers = layers_for(case, LLAMA3_8B, device)
    p = make_problem(case, LLAMA3_8B, layers, torch.bfloat16, device)
    err = check_against_reference(p)
    assert err < 2e-2, f"triton SGMV differs from the reference: {err:.2e}"
    nbytes = minimal_bytes(case, LLAMA3_8B)
    us = graph_us_per_layer(p, sgmv_layer)
    floor_us = nbytes / bw * 1e6
    row = {
        "phase": case.phase,
        "tokens": case.num_tokens,
        "adapters": case.num_adapters,
        "ranks": case.rank_label,
        "layers": layers,
        "sgmv_us": us,
        "floor_us": floor_us,
        "frac_of_floor": floor_us / us,
        "GBps": nbytes / us / 1e3,
        "MB": nbytes / 1e6,
        "rel_err": err,
    }
    if not args.no_baseline:
        row["baseline_us"] = graph_us_per_layer(p, gather_bmm_layer, iters=5)
        row["speedup"] = row["baseline_us"] / us
    if args.variants:  # what programmatic dependent launch buys, in the same run
        from kernels import sgmv_triton

        sgmv_triton.PDL = False
        try:
            row["no_pdl_us"] = graph_us_per_layer(p, sgmv_layer)
        finally:
            sgmv_triton.PDL = True
    if args.breakdown:  # per group: (shrink alone, expand alone)
        p.h = layer0_h(p)
        row["groups_us"] = {
            g: (round(graph_us_per_layer(p, shrink_layer, [g]), 2),
                round(graph_us_per_layer(p, expand_layer, [g]), 2))
            for g in p.shapes
        }
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    del p
    torch.cuda.empty_cache()
    return row


QUICK = [  # the design targets: latency at B=1 and 8, bandwidth at B=D=64, mixed rank, prefill
    Case("decode", (1,), (16,), "16"),
    Case("decode", (1,) * 8, (16,) * 8, "16"),
    Case("decode", (1,) * 64, (16,) * 64, "16"),
    Case("decode", (8,) * 8, (16,) * 8, "16"),
    Case("decode", (1,) * 64, tuple(MIXED_RANKS[i % 4] for i in range(64)), "mixed"),
    Case("prefill", (512,) * 4, (16,) * 4, "16"),
]
SWEEP_EXTRA = [  # --sweep-cases 6 and 7: many tokens over few adapters, one tile per 16
    Case("decode", (128,), (16,), "16"),
    Case("decode", (16,) * 8, (64,) * 8, "64"),
    # 8-10: a pool of rank 128 (large adapters), prompts of a few hundred tokens and mixed steps
    Case("decode", (128,), (128,), "128"),
    Case("decode", (32,) * 4, (128,) * 4, "128"),
    Case("prefill", (256,), (128,), "128"),
    # 11-12: B = 8 over 8 adapters of a pool of rank 64: one rank, and ranks 8-64
    Case("decode", (1,) * 8, (64,) * 8, "64"),
    Case("decode", (1,) * 8, tuple(MIXED_RANKS[i % 4] for i in range(8)), "mixed"),
    # 13-16: the latency cells past 10 us: one token of rank 64, 8 tokens over one adapter of
    # rank 64 and of rank 16, 8 tokens over 8 rank-8 adapters
    Case("decode", (1,), (64,), "64"),
    Case("decode", (8,), (64,), "64"),
    Case("decode", (8,), (16,), "16"),
    Case("decode", (1,) * 8, (8,) * 8, "8"),
    # 17-18: a skewed decode batch (popular adapters share it with many requests of their own),
    # rank 16 and ranks 8-64
    SKEWED,
    SKEWED_MIXED,
]


def sweep(args: argparse.Namespace) -> None:
    """Time shrink alone and expand alone (all four groups of a layer) over candidate tilings,
    the current table row first, for the quick cases named by `--sweep-cases`, plus a graph
    of empty kernels (the launch floor); prints each time and the best per kernel, writes
    nothing."""
    from dataclasses import replace

    from benchmarks.common import time_cuda
    from kernels.sgmv_tuning import NO_SPLIT

    noop = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    noop.add_(1)
    with torch.cuda.graph(graph):
        for _ in range(100):
            noop.add_(1)
    print(f"launch floor: {time_cuda(graph.replay) / 100:.2f} us per tiny kernel in a graph")

    device = torch.device("cuda")
    # the bandwidth target first, then a few tokens per adapter, then latency at B = 1
    for case in ((QUICK + SWEEP_EXTRA)[i] for i in args.sweep_cases):
        p = make_problem(case, LLAMA3_8B, layers_for(case, LLAMA3_8B, device), torch.bfloat16,
                         device)
        p.h = layer0_h(p)
        base_s, base_e = table_rows(p)
        # block_m 1: every tile one token, each item whole rows of A (max_a_block elements, no
        # split-K; a segment of several tokens re-reads its weights per token, from L2);
        # block_m 16: 16-token tiles with split-K
        shrinks = [base_s] + [
            replace(base_s, block_m=bm, block_n=bn, block_k=bk, k_per_split=kps, num_warps=w,
                    num_stages=st, programs_per_sm=pps, max_a_block=ma, live_items=False)
            for bm, bn, bk, kps, w, st, pps, ma in (
                (1, 16, 16384, NO_SPLIT, 4, 1, 8, 4096),
                # several whole rows of A per one-token item (fewer, larger reads), other
                # program counts and widths
                *((1, 16, 16384, NO_SPLIT, w, 1, pps, ma) for ma in (4096, 8192, 16384, 32768)
                  for w, pps in ((2, 16), (4, 4), (4, 16), (8, 4), (8, 8))),
                (16, 32, 256, 1024, 4, 3, 16, None),
                (16, 32, 256, 1024, 8, 3, 8, None), (16, 32, 256, 1024, 4, 1, 16, None),
                (16, 32, 256, 1024, 8, 2, 4, None), (16, 16, 256, 1024, 8, 3, 8, None),
            )
        ]
        # one-token rows over 8 or 16 warps at 1-3 per SM, with and without items only below
        # each slot's rank (live_items)
        shrinks += [
            replace(base_s, block_m=1, block_n=16, block_k=16384, k_per_split=NO_SPLIT,
                    num_warps=w, num_stages=1, programs_per_sm=pps, max_a_block=ma,
                    tile_k=None, live_items=lv)
            for ma, w, pps, lv in ((32768, 8, 2, False), (32768, 8, 2, True),
                                   (32768, 8, 3, True), (65536, 8, 2, True),
                                   (65536, 8, 1, True), (65536, 16, 1, True),
                                   (65536, 16, 2, True), (32768, 16, 1, True))
        ]
        # B is rank-major ([slots, R, out]): a one-token item's sum over the rank stays inside
        # each thread only where the block's columns span every thread (8 x 32 x num_warps);
        # narrower blocks spread rank rows over threads and warps and reduce through shared memory
        expands = [base_e] + [
            replace(base_e, block_n=bn, block_r=br, num_warps=w, programs_per_sm=pps, tile_n=tn,
                    max_tile=None)
            for bn, br, w, pps, tn in (
                (256, 16, 1, 32, 128), (512, 16, 2, 16, 128), (1024, 16, 4, 8, 128),
                (128, 16, 1, 32, 128), (256, 16, 2, 16, 128), (512, 16, 4, 16, 128),
                (512, 32, 2, 16, 128), (256, 32, 1, 32, 128), (1024, 16, 4, 4, 128),
                (512, 16, 2, 32, 128),
                # wider rank steps for pools of a large max rank (tiles of several tokens)
                (128, 32, 1, 32, 128), (128, 64, 2, 16, 128), (128, 64, 4, 8, 128),
                (256, 64, 4, 8, 128), (128, 128, 4, 8, 128), (64, 64, 1, 32, 64),
                # one-token items over 8 warps (2048 columns span every thread), and wider rank
                # steps over 4 (fewer dependent steps for large ranks)
                (2048, 16, 8, 4, 128), (2048, 16, 8, 8, 128), (1024, 32, 4, 4, 128),
                (1024, 32, 8, 4, 128), (1024, 16, 4, 2, 128),
            )
        ]
        # 16-token tiles (tile products): a segment of several tokens reads its B block once
        expands += [
            replace(base_e, block_m=16, block_n=bn, block_r=br, num_warps=w, programs_per_sm=pps,
                    tile_n=tn, max_tile=None)
            for bn, br, w, pps, tn in (
                (64, 16, 1, 32, 64), (64, 64, 1, 32, 64), (128, 16, 1, 32, 128),
                (128, 64, 2, 16, 128), (128, 64, 4, 8, 128), (128, 32, 2, 16, 64),
                (256, 16, 2, 16, 128), (256, 64, 4, 8, 128), (512, 16, 4, 8, 128),
                # one warp per tile (a one-token tile beside them sums its rank in-thread)
                (256, 16, 1, 32, 128), (256, 32, 1, 32, 128), (128, 64, 1, 32, 128),
                (256, 64, 1, 32, 128),
            )
        ]
        print(f"== {case.phase} tokens {case.num_tokens} adapters {case.num_adapters}", flush=True)
        for kind, candidates, layer_fn in (
            ("shrink", shrinks, shrink_layer),
            ("expand", expands, expand_layer),
        ):
            if args.sweep_kernel not in (None, kind):
                continue
            results = []
            for t in candidates:
                try:
                    with only_rows(**{kind: t}):
                        us = graph_us_per_layer(p, layer_fn)  # all four groups: one layer
                except Exception as e:  # a tiling the compiler or the GPU refuses
                    print(f"{kind} {t} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                results.append((us, t))
                print(f"{kind} {t} {us:.2f}", flush=True)
            if results:
                best_us, best = min(results, key=lambda r: r[0])
                print(f"best {kind} at {case.num_tokens} tokens: {best_us:.2f} us/layer "
                      f"(table row {results[0][0]:.2f}): {best}", flush=True)
        del p
        torch.cuda.empty_cache()


def compiled_kernels(jit_fn) -> list:
    """The compiled variants of a Triton kernel launched so far in this process."""
    found = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for part in cache if isinstance(cache, tuple) else (cache,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "n_regs")]
    return found


def resident_programs(kernel, props) -> int:
    """Programs of `kernel` an SM holds at once: registers, shared memory and warp slots."""
    warps = kernel.metadata.num_warps
    regs = max(1, kernel.n_regs) * 32 * warps
    by_regs = props.regs_per_multiprocessor // regs
    shared = kernel.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else 32
    return min(by_regs, by_shared, props.max_threads_per_multi_processor // (32 * warps), 32)


@functools.cache
def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src, out, n_items, CHUNK: tl.constexpr):
        acc = tl.zeros((CHUNK,), dtype=tl.float32)
        offs = tl.arange(0, CHUNK)
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            acc += tl.load(src + item.to(tl.int64) * CHUNK + offs).to(tl.float32)
        tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))

    return read_kernel


def stream_read_us(tensors: list[torch.Tensor], chunk: int, programs_per_sm: int) -> float:
    """µs to read `tensors` once in `chunk`-element items by a persistent Triton kernel of
    `programs_per_sm` programs per SM: what this access pattern can reach, beside the kernels."""
    from benchmarks.common import time_cuda

    kernel = _read_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flat = [t.reshape(-1)[: t.numel() // chunk * chunk] for t in tensors]
    grids = [min(f.numel() // chunk, sms * programs_per_sm) for f in flat]
    out = torch.empty(max(grids), device="cuda")
    warps = max(4, chunk // 1024)  # at most 32 float32 accumulators per thread

    def run():
        for f, g in zip(flat, grids, strict=True):
            kernel[(g,)](f, out, f.numel() // chunk, CHUNK=chunk, num_warps=warps)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return time_cuda(graph.replay, iters=20, repeats=5, warmup=3)


def inspect(args: argparse.Namespace) -> None:
    """For the quick cases of `--sweep-cases`: each compiled shrink and expand variant's
    registers, spills, shared memory and programs per SM, the expand alone against a plain
    streaming read of the same B bytes (same item size), and one eager layer for a profiler to
    catch. Prints; writes nothing."""
    from kernels import sgmv_triton

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    for case in (QUICK[i] for i in args.sweep_cases):
        p = make_problem(case, LLAMA3_8B, layers_for(case, LLAMA3_8B, device), torch.bfloat16,
                         device)
        p.h = layer0_h(p)
        print(f"== {case.phase} tokens {case.num_tokens} adapters {case.num_adapters} "
              f"ranks {case.rank_label}", flush=True)
        sgmv_layer(p, 0)
        torch.cuda.synchronize()
        for name, fn in (("shrink", sgmv_triton._sgmv_shrink_kernel),
                         ("expand", sgmv_triton._sgmv_expand_kernel)):
            for k in compiled_kernels(fn):
                consts = getattr(getattr(k, "src", None), "constants", {}) or {}
                keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "SPLIT_K", "NUM_COLS", "O_4",
                        "BLOCKS_PER_ITEM")
                shown = {kk: v for kk, v in consts.items() if str(kk).split("'")[-1] in keys}
                print(f"{name}: warps {k.metadata.num_warps} regs {k.n_regs} spills "
                      f"{k.n_spills} shared {k.metadata.shared} resident/SM "
                      f"{resident_programs(k, props)} {shown}", flush=True)
        expand_us = graph_us_per_layer(p, expand_layer)
        b_bytes = sum(p.weights[0][g][1].numel() * 2 for g in p.shapes)
        print(f"expand alone {expand_us:.1f} us/layer over {b_bytes / 1e6:.1f} MB of B pool "
              f"({b_bytes / expand_us / 1e6:.2f} TB/s if every byte were read)", flush=True)
        live = [p.weights[layer][g][1] for layer in range(len(p.weights)) for g in p.shapes]
        for chunk, pps in ((8192, 4), (8192, 8), (8192, 16), (4096, 16), (16384, 4)):
            us = stream_read_us(live, chunk, pps) / len(p.weights)
            print(f"stream read of the same B, {chunk * 2 // 1024} KB items, {pps} programs/SM: "
                  f"{us:.1f} us/layer ({b_bytes / us / 1e6:.2f} TB/s)", flush=True)
        for _ in range(3):  # eager layers, for a profiler
            sgmv_layer(p, 1)
        torch.cuda.synchronize()
        del p
        torch.cuda.empty_cache()


@contextlib.contextmanager
def only_rows(shrink=None, expand=None):
    """Every launch inside takes these tilings (None: the kernel's tables as they are)."""
    from kernels import sgmv_triton
    from kernels.sgmv_tuning import TABLE_NAMES

    names = [f"{k}_{t}" for k in ("SHRINK", "EXPAND")
             for t in TABLE_NAMES]
    saved = {n: getattr(sgmv_triton, n) for n in names}
    for kernel, tiling in (("SHRINK", shrink), ("EXPAND", expand)):
        if tiling is not None:
            for t in TABLE_NAMES:
                setattr(sgmv_triton, f"{kernel}_{t}", ((None, tiling),) if t == "TABLE" else ())
    try:
        yield
    finally:
        for n, table in saved.items():
            setattr(sgmv_triton, n, table)


def sweep_small(args: argparse.Namespace) -> None:
    """The <= 16-token row, whole layers: every (shrink, expand) pair of candidates at B = 1 and
    B = 8, since under programmatic dependent launch a kernel's cost depends on its neighbour
    (its prologue and first weight read overlap the kernel before). Prints; writes nothing."""
    from dataclasses import replace

    from kernels import sgmv_triton
    from kernels.sgmv_tuning import SHRINK_TABLE, ShrinkTiling, pick

    base_s, base_e = pick(SHRINK_TABLE, 1), pick(sgmv_triton._expand_table(True, 16), 1)
    # tiles of one token (the decode batches' shape) take matrix-vector products; the row's
    # shrink splits no K: each item holds a few whole rows of A (max_a_block elements), read
    # before the wait, and writes h itself (no partials, no arrival, no reducer)
    split_k = ShrinkTiling(16, 16, 1024, 1024, num_warps=4, num_stages=1, programs_per_sm=8,
                           tile_k=128)  # the row before: K splits of 1024, reduced on arrival
    shrinks = [base_s, split_k] + [
        replace(base_s, num_warps=w, programs_per_sm=pps, max_a_block=ma)
        for ma, w, pps in ((4096, 4, 8), (8192, 4, 16), (4096, 4, 16))
    ]
    expands = [base_e] + [
        replace(base_e, block_m=1, block_n=bn, num_warps=w, programs_per_sm=pps)
        for bn, w, pps in ((256, 1, 32), (512, 2, 16), (1024, 4, 4))
    ]
    for case in (QUICK[0], QUICK[1], Case("decode", (16,), (16,), "16")):
        time_pairs(case, lambda p: (shrinks, expands))


def table_rows(p: Problem) -> tuple:
    """The (shrink, expand) tilings the kernels' tables pick for the problem's batch."""
    from kernels import sgmv_triton
    from kernels.sgmv_tuning import pick

    one_token, max_rank = p.batch.one_token_segments, p.case.max_rank
    return (pick(sgmv_triton._shrink_table(one_token, max_rank), p.case.num_tokens),
            pick(sgmv_triton._expand_table(one_token, max_rank), p.case.num_tokens))


def time_pairs(case: Case, candidates) -> None:
    """Whole layers of `case` over every (shrink, expand) pair of `candidates(problem)` (two
    lists, the table rows first), printed with the best pair."""
    device = torch.device("cuda")
    p = make_problem(case, LLAMA3_8B, layers_for(case, LLAMA3_8B, device), torch.bfloat16,
                     device)
    shrinks, expands = candidates(p)
    print(f"== {case.phase} tokens {case.num_tokens} adapters {case.num_adapters} ranks "
          f"{case.rank_label}", flush=True)
    results = []
    for t_s in shrinks:
        for t_e in expands:
            try:
                with only_rows(shrink=t_s, expand=t_e):
                    us = graph_us_per_layer(p, sgmv_layer)
            except Exception as e:  # a tiling the compiler or the GPU refuses
                print(f"{t_s} {t_e} failed: {type(e).__name__}: {e}", flush=True)
                continue
            results.append((us, t_s, t_e))
            print(f"{us:.2f} us/layer: {t_s} {t_e}", flush=True)
    best = min(results, key=lambda r: r[0])
    print(f"best at {case.num_tokens} tokens: {best[0]:.2f} us/layer (table rows "
          f"{results[0][0]:.2f}): {best[1]} {best[2]}", flush=True)
    del p
    torch.cuda.empty_cache()


def sweep_pairs(args: argparse.Namespace) -> None:
    """For the cases of `--sweep-cases`: whole layers over every pair of shrink and expand
    candidates around the rows each case picks (warps, programs per SM and rows of A per item
    for the shrink; column blocks, rank steps, warps and programs per SM for the expand), since
    under programmatic dependent launch a kernel's cost depends on its neighbour. Prints; writes
    nothing."""
    from dataclasses import replace

    def candidates(p: Problem) -> tuple:
        s0, e0 = table_rows(p)
        shrinks = [s0] + [
            replace(s0, num_warps=w, programs_per_sm=pps, max_a_block=ma)
            for ma, w, pps in ((4096, 8, 8), (16384, 4, 4), (8192, 8, 8), (4096, 4, 16),
                               (8192, 4, 8), (16384, 8, 4))
        ] if s0.block_m == 1 else [s0]
        expands = [e0] + [
            replace(e0, block_n=bn, block_r=br, num_warps=w, programs_per_sm=pps)
            for bn, br, w, pps in ((64, 64, 1, 16), (128, 64, 2, 16), (64, 32, 1, 32),
                                   (32, 64, 1, 32), (128, 32, 1, 32))
        ]
        return shrinks, expands

    for case in ((QUICK + SWEEP_EXTRA)[i] for i in args.sweep_cases):
        time_pairs(case, candidates)


def sweep_segments(args: argparse.Namespace) -> None:
    """Batches of 17-128 tokens whose segments hold several tokens (a popular adapter shares the
    batch with many requests): whole layers over the shrink's candidates there, 16-token tiles
    with K split 1024 or 512 and, up to 32 tokens, one-token tiles (the expand's table row).
    Prints; writes nothing."""
    from dataclasses import replace

    from kernels.sgmv_tuning import SHRINK_TABLE, pick

    one_token = pick(SHRINK_TABLE, 32)  # the rank-16 pools' one-token tiles up to 32 tokens

    def candidates(p: Problem) -> tuple:
        s0, e0 = table_rows(p)
        tiles = s0 if s0.block_m == 16 else pick(SHRINK_TABLE, 128)
        shrinks = [s0] + [t for t in (replace(tiles, k_per_split=1024),
                                      replace(tiles, k_per_split=512)) if t != s0]
        if p.case.num_tokens <= 32 and s0 != one_token:
            shrinks.append(one_token)
        return shrinks, [e0]

    mixed = tuple(MIXED_RANKS[i % 4] for i in range(8))
    skewed_32 = (8, 4, 2, 2) + (1,) * 16
    for case in (Case("decode", (32,), (16,), "16"), Case("decode", (4,) * 8, (16,) * 8, "16"),
                 Case("decode", skewed_32, (16,) * len(skewed_32), "16"),
                 Case("decode", (4,) * 8, mixed, "mixed"),
                 Case("decode", (4,) * 8, (64,) * 8, "64"),
                 Case("decode", (64,), (16,), "16"), Case("decode", (8,) * 8, (16,) * 8, "16"),
                 Case("decode", (128,), (16,), "16"), SKEWED, SWEEP_EXTRA[1], SWEEP_EXTRA[2],
                 SKEWED_MIXED):
        time_pairs(case, candidates)


def sweep_latency(args: argparse.Namespace) -> None:
    """The B <= 16 cells, whole layers, over the expand's programs per SM: `bench_sgmv_timeline`
    showed the gate/up expand's programs at 8 tokens (224 items) starting only as earlier
    kernels left the SMs, their blocks of B read only then; a grid of fewer programs, each
    taking its items in turn, starts all of them early. For the cases of `--sweep-cases`
    (default: 0, 1, 15, 16 and 16 tokens over 16 adapters). Prints; writes nothing."""
    from dataclasses import replace

    def candidates(p: Problem) -> tuple:
        s0, e0 = table_rows(p)
        return [s0], [e0] + [replace(e0, programs_per_sm=pps) for pps in (1, 3)
                             if pps != e0.programs_per_sm]

    picks = args.sweep_cases if args.sweep_cases != [2, 3, 0] else [0, 1, 15, 16]
    sixteen = Case("decode", (1,) * 16, (16,) * 16, "16")
    for case in [(QUICK + SWEEP_EXTRA)[i] for i in picks] + [sixteen]:
        time_pairs(case, candidates)


def residency(args: argparse.Namespace) -> None:
    """For the cases of `--sweep-cases`: a layer, its shrinks alone and its expands alone with
    the layers' weights rotating past L2 (as measured) and with every layer the same tensors
    (L2-resident), to tell weight bandwidth from the kernels' own latency: a cell whose
    L2-resident layer stays past a goal misses it on latency, whatever its weights' reads do.
    Writes `sgmv_residency`."""
    from benchmarks.common import write_results

    device = torch.device("cuda")
    rows = []
    for case in ((QUICK + SWEEP_EXTRA)[i] for i in args.sweep_cases):
        layers = layers_for(case, LLAMA3_8B, device)
        row = {"phase": case.phase, "tokens": case.num_tokens, "adapters": case.num_adapters,
               "ranks": case.rank_label, "weights_MB": weight_bytes(case, LLAMA3_8B) / 1e6}
        for weights in ("rotating", "resident"):
            p = make_problem(case, LLAMA3_8B, layers, torch.bfloat16, device)
            if weights == "resident":
                p.weights = [p.weights[0]] * layers
            p.h = layer0_h(p)
            for part, fn in (("layer", sgmv_layer), ("shrinks", shrink_layer),
                             ("expands", expand_layer)):
                row[f"{part}_{weights}_us"] = graph_us_per_layer(p, fn)
            del p
        row["resident_over_rotating"] = row["layer_resident_us"] / row["layer_rotating_us"]
        rows.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()},
              flush=True)
        torch.cuda.empty_cache()
    path = write_results(
        args.out, "sgmv_residency",
        "SGMV layers with their weights rotating past L2 and L2-resident (CUDA-graph replay)",
        "µs per layer (all seven projections, bf16), and its shrinks and expands alone, with "
        "each layer's weights fresh (rotating past L2, as bench_sgmv measures) against every "
        "layer on the same weights (L2-resident) in the same run; resident_over_rotating = the "
        "layer's resident time / its rotating time (1.0: the weights' reads cost nothing); a "
        "layer's weights past the L2's size (l2_MB) cannot stay resident",
        ["phase", "tokens", "adapters", "ranks", "weights_MB", "layer_rotating_us",
         "layer_resident_us", "resident_over_rotating", "shrinks_rotating_us",
         "shrinks_resident_us", "expands_rotating_us", "expands_resident_us"],
        rows,
        {"l2_MB": torch.cuda.get_device_properties(device).L2_cache_size / 1e6},
    )
    print(f"wrote {path}")


def sgmv_triton_pdl() -> bool:
    from kernels import sgmv_triton

    return sgmv_triton._pdl_enabled(torch.device("cuda"))


def run_gpu(args: argparse.Namespace) -> None:
    from benchmarks.common import hbm_bandwidth, write_results

    args.out = args.out or "benchmarks/results"
    torch.manual_seed(0)
    if args.sweep:
        sweep(args)
        return
    if args.sweep_small:
        sweep_small(args)
        return
    if args.inspect:
        inspect(args)
        return
    if args.residency:
        residency(args)
        return
    if args.sweep_pairs:
        sweep_pairs(args)
        return
    if args.sweep_segments:
        sweep_segments(args)
        return
    if args.sweep_latency:
        sweep_latency(args)
        return
    bw = hbm_bandwidth()
    print(f"HBM copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = [measure(case, bw, args) for case in (QUICK if args.quick else cases(args.only))]
    path = write_results(
        args.out,
        "sgmv_quick" if args.quick else "sgmv",  # the quick set never overwrites the full one
        "SGMV LoRA, one Llama-3-8B layer (q/k/v, o, gate/up, down), bf16, CUDA-graph replay",
        "µs per layer for all seven projections; floor = minimal bytes (weights once per distinct "
        "adapter at its true rank + x in, y in/out) / HBM bandwidth; frac_of_floor = floor / "
        "measured; baseline = torch gather + bmm at the pool's max rank, also graph-replayed",
        ["phase", "tokens", "adapters", "ranks", "sgmv_us", "floor_us", "frac_of_floor", "GBps",
         "baseline_us", "speedup"]
        + (["no_pdl_us"] if args.variants else []),
        rows,
        {"hbm_bandwidth_TBps": round(bw / 1e12, 3),
         "programmatic_dependent_launch": sgmv_triton_pdl()},
    )
    print(f"wrote {path}")


def run_smoke(args: argparse.Namespace) -> None:
    """Tiny sizes on CPU through the interpreter: the kernels agree with the reference and the
    benchmark's plumbing runs; the times say nothing about a GPU."""
    torch.manual_seed(0)
    rows = []
    smoke_cases = [
        Case("decode", (1, 1, 1), (8, 16, 4), "mixed"),
        Case("decode", (4,), (16,), "16"),
        Case("prefill", (9, 7), (16, 8), "mixed"),
    ]
    for case in smoke_cases:
        p = make_problem(case, TINY, 2, torch.float32, torch.device("cpu"))
        err = check_against_reference(p)
        assert err < 1e-4, f"triton SGMV differs from the reference: {err:.2e}"
        start = time.perf_counter()
        sgmv_layer(p, 1)
        ms = (time.perf_counter() - start) * 1e3
        gather_bmm_layer(p, 1)
        rows.append({"phase": case.phase, "tokens": case.num_tokens,
                     "adapters": case.num_adapters, "ranks": case.rank_label,
                     "MB": minimal_bytes(case, TINY, 4) / 1e6, "interpreter_ms": ms,
                     "rel_err": err})
        print(rows[-1], flush=True)
    if args.out:
        from benchmarks.common import write_results

        write_results(args.out, "sgmv_smoke", "SGMV LoRA, smoke (CPU, Triton interpreter)",
                      "correctness and plumbing only",
                      ["phase", "tokens", "adapters", "ranks", "MB", "interpreter_ms", "rel_err"],
                      rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    ap.add_argument("--quick", action="store_true", help="only the cases behind the targets")
    ap.add_argument("--breakdown", action="store_true", help="also time each group alone")
    ap.add_argument("--sweep", action="store_true", help="time candidate tilings; writes nothing")
    ap.add_argument("--sweep-cases", default="2,3,0",
                    type=lambda v: [int(i) for i in v.split(",")],
                    help="which quick cases --sweep times (indices: 0 B=1, 1 B=8, 2 B=D=64, "
                         "3 B=64 over 8 adapters, 4 mixed ranks, 5 prefill, 6 B=128 over one "
                         "adapter, 7 B=128 over 8 adapters of rank 64, 11-12 B=8 over 8 "
                         "adapters of rank 64 and ranks 8-64, 13 one rank-64 token, 14-15 B=8 "
                         "over one adapter of rank 64 and 16, 16 B=8 over 8 of rank 8, 17-18 64 "
                         "tokens over 32 adapters, skewed, rank 16 and ranks 8-64)")
    ap.add_argument("--sweep-kernel", choices=["shrink", "expand"], default=None,
                    help="--sweep times only this kernel's candidates")
    ap.add_argument("--sweep-small", action="store_true",
                    help="time (shrink, expand) pairs for <= 16 tokens, whole layers; "
                         "writes nothing")
    ap.add_argument("--inspect", action="store_true",
                    help="registers, occupancy and a streaming-read bound for --sweep-cases; "
                         "writes nothing")
    ap.add_argument("--sweep-pairs", action="store_true",
                    help="whole layers over (shrink, expand) pairs around the rows of "
                         "--sweep-cases; writes nothing")
    ap.add_argument("--sweep-segments", action="store_true",
                    help="whole layers over the shrink's rows for 17-128 tokens in segments of "
                         "several tokens; writes nothing")
    ap.add_argument("--sweep-latency", action="store_true",
                    help="the B <= 16 cells over the expand's programs per SM, whole layers "
                         "(default cases 0,1,15,16 and 16 over 16); writes nothing")
    ap.add_argument("--residency", action="store_true",
                    help="--sweep-cases with weights rotating past L2 and L2-resident; "
                         "writes sgmv_residency")
    ap.add_argument("--no-baseline", action="store_true", help="skip the gather-bmm baseline")
    ap.add_argument("--variants", action="store_true",
                    help="also time without programmatic dependent launch")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, no GPU needed")
    ap.add_argument("--out", default=None,
                    help="results folder (default benchmarks/results on GPU; none in --smoke)")
    args = ap.parse_args()
    from benchmarks.common import run_smoke_or_gpu

    run_smoke_or_gpu(args, run_smoke, run_gpu)


if __name__ == "__main__":
    main()
