"""SGMV LoRA deltas of one Llama-3-8B layer (all seven projections) under CUDA-graph replay,
against the memory floor and a torch gather-bmm baseline.

    python -m benchmarks.bench_sgmv [--out DIR] [--no-baseline]
    python -m benchmarks.bench_sgmv --quick    # only the cases behind the design targets
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

The kernels run under `DEFAULT_TUNING` (kernels/sgmv_tuning.py).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch

from replicas.lora import LORA_GROUPS
from replicas.models.spec import ModelSpec
from synthetic import presets


def lora_group_shapes(config: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """group -> (input width, output widths of the fused slices) of a model's config.json."""
    spec = ModelSpec.from_dict(config)
    return {
        group: (spec.lora_dims(targets[0])[0], tuple(spec.lora_dims(t)[1] for t in targets))
        for group, targets in LORA_GROUPS.items()
    }


LLAMA3_8B = lora_group_shapes(presets.LLAMA3_8B)  # qkv: 4096 -> (4096, 1024, 1024), ...
TINY = lora_group_shapes(presets.TINY)
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
SKEWED_MIXED = Case(
    "decode", SKEWED_SEGMENTS, tuple(MIXED_RANKS[i % 4] for i in range(32)), "mixed"
)


def cases() -> list[Case]:
    out = []
    rank_sets = [(str(r), lambda d, r=r: (r,) * d) for r in (8, 16, 64)]
    rank_sets.append(("mixed", lambda d: tuple(MIXED_RANKS[i % 4] for i in range(d))))
    for b in (1, 8, 32, 64, 128):
        for d in sorted({1, 8, b} & set(range(1, b + 1))):
            for label, ranks in rank_sets:
                out.append(Case("decode", (b // d,) * d, ranks(d), label))
    out += [SKEWED, SKEWED_MIXED]  # 64 tokens over 32 adapters, segments of 16 down to 1
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
    sgmv: object  # SgmvBackend: the Triton kernels under the problem's tuning
    token_slots: torch.Tensor  # [T] int64, for the baseline
    token_scale: torch.Tensor  # [T, 1] for the baseline

    def offsets(self, group: str) -> tuple[int, ...]:
        offsets = [0]
        for w in self.shapes[group][1]:
            offsets.append(offsets[-1] + w)
        return tuple(offsets)


def make_problem(case: Case, shapes: dict, layers: int, dtype, device, tuning=None) -> Problem:
    from kernels.sgmv import SgmvBatch, get_backend
    from kernels.sgmv_tuning import DEFAULT_TUNING

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
    sgmv = get_backend("triton", tuning or DEFAULT_TUNING)
    return Problem(case, shapes, weights, x, y, batch, sgmv, token_slots.to(device), token_scale)


def sgmv_layer(p: Problem, layer: int) -> None:
    for group in p.shapes:
        a, b = p.weights[layer][group]
        p.sgmv.apply(p.x[group], a, b, p.batch, p.y[group], p.offsets(group))


def gather_bmm_layer(p: Problem, layer: int) -> None:
    """Per-token gather of the weights at the pool's max rank, then two batched products."""
    for group in p.shapes:
        a, b = p.weights[layer][group]
        n, max_rank = len(p.shapes[group][1]), b.shape[1]
        h = torch.bmm(a[p.token_slots], p.x[group][:, :, None])  # [T, n*R, 1]
        b_tok = b[p.token_slots].transpose(1, 2)  # [T, d_out, R] (a transposed view)
        offsets = p.offsets(group)
        for i in range(n):
            o0, o1 = offsets[i], offsets[i + 1]
            delta = torch.bmm(b_tok[:, o0:o1], h[:, i * max_rank : (i + 1) * max_rank])
            p.y[group][:, o0:o1] += p.token_scale * delta[:, :, 0]


def graph_us_per_layer(p: Problem, layer_fn, iters: int = 20) -> float:
    """Capture `layer_fn` over every layer into one CUDA graph; µs per layer over its replays
    (the run before the capture also grows the split-K counters)."""
    from benchmarks.common import graph_replay_us

    def step():
        for layer in range(len(p.weights)):
            layer_fn(p, layer)

    return graph_replay_us(step, iters) / len(p.weights)


def check_against_reference(p: Problem) -> float:
    """Largest relative error of the Triton delta vs the torch reference (float32), layer 0."""
    from kernels.sgmv import torch_expand, torch_shrink

    worst = 0.0
    for group, (_, outs) in p.shapes.items():
        a, b = p.weights[0][group]
        x = p.x[group]
        y = torch.zeros_like(p.y[group])
        p.sgmv.apply(x, a, b, p.batch, y, p.offsets(group))
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


def run_gpu(args: argparse.Namespace) -> None:
    from benchmarks.common import hbm_bandwidth, write_results
    from kernels.sgmv_triton import pdl_supported
    from kernels.sgmv_tuning import DEFAULT_TUNING

    torch.manual_seed(0)
    bw = hbm_bandwidth()
    print(f"HBM copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = [measure(case, bw, args) for case in (QUICK if args.quick else cases())]
    path = write_results(
        args.out,
        "sgmv_quick" if args.quick else "sgmv",  # the quick set never overwrites the full one
        "SGMV LoRA, one Llama-3-8B layer (q/k/v, o, gate/up, down), bf16, CUDA-graph replay",
        "µs per layer for all seven projections; floor = minimal bytes (weights once per distinct "
        "adapter at its true rank + x in, y in/out) / HBM bandwidth; frac_of_floor = floor / "
        "measured; baseline = torch gather + bmm at the pool's max rank, also graph-replayed",
        ["phase", "tokens", "adapters", "ranks", "sgmv_us", "floor_us", "frac_of_floor", "GBps"]
        + ([] if args.no_baseline else ["baseline_us", "speedup"]),
        rows,
        {
            "hbm_bandwidth_TBps": round(bw / 1e12, 3),
            "programmatic_dependent_launch": DEFAULT_TUNING.pdl
            and pdl_supported(torch.device("cuda")),
        },
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
        rows.append(
            {
                "phase": case.phase,
                "tokens": case.num_tokens,
                "adapters": case.num_adapters,
                "ranks": case.rank_label,
                "MB": minimal_bytes(case, TINY, 4) / 1e6,
                "interpreter_ms": ms,
                "rel_err": err,
            }
        )
        print(rows[-1], flush=True)
    if args.out:
        from benchmarks.common import write_results

        write_results(
            args.out,
            "sgmv_smoke",
            "SGMV LoRA, smoke (CPU, Triton interpreter)",
            "correctness and plumbing only",
            ["phase", "tokens", "adapters", "ranks", "MB", "interpreter_ms", "rel_err"],
            rows,
        )


def main() -> None:
    from benchmarks.common import run_smoke_or_gpu, smoke_or_gpu_parser

    ap = smoke_or_gpu_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="only the cases behind the targets")
    ap.add_argument("--no-baseline", action="store_true", help="skip the gather-bmm baseline")
    run_smoke_or_gpu(ap.parse_args(), run_smoke, run_gpu)


if __name__ == "__main__":
    main()
