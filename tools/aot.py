"""Compile the SGMV Triton kernels for an NVIDIA GPU on a machine without one.

Triton's compiler and its bundled `ptxas` need no GPU: a launch plan (the tuning row's tiling,
the block arithmetic and the launch options, exactly as `kernels/sgmv_triton.py` builds them)
goes through every stage down to the cubin for the target. That catches what the interpreter
cannot (Triton's typing of `if` branches, layouts, the launch options) before a GPU sees it, and
reads each kernel's registers, stack and spills, which decide how many programs an SM holds.

    python -m tools.aot                # every tuning row, bf16 and float32, with and without PDL
    python -m tools.aot --tokens 1,64  # only the rows these token counts pick
    python -m tools.aot --max-ranks 64 # pools of max rank 64 only

Needs the compiled kernels (not the interpreter): run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

# Llama-3-8B's fused groups: (input width, output widths)
GROUPS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
HOPPER = ("cuda", 90, 32)  # backend, compute capability, warp size
NUM_SMS = 132  # an H100 SXM
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")

_POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


@dataclass(frozen=True)
class Usage:
    registers: int
    stack: int
    local: int

    def programs_per_sm(self, num_warps: int, regs_per_sm: int = 65536) -> int:
        """Programs an SM holds by registers alone (allocated per warp in units of 256)."""
        per_warp = -(-max(self.registers, 1) * 32 // 256) * 256
        return min(regs_per_sm // (per_warp * num_warps), 64 // num_warps)


def compile_kernel(kernel, types: dict[str, str], constants: dict, ints: dict[str, int]):
    """`kernel` (a @triton.jit function) compiled for Hopper. `types`: each runtime argument's
    Triton type; `constants`: the constexprs and launch options of a plan; `ints`: the integer
    arguments' values. As a launch would, pointers and integers that are multiples of 16 are
    marked divisible by 16 (aligned, vectorized accesses: without it registers double)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(kernel, "arg_names") or type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("tools.aot needs compiled kernels: unset TRITON_INTERPRET")
    constexprs = {k: v for k, v in constants.items() if k not in LAUNCH_OPTIONS}
    options = {k: v for k, v in constants.items() if k in LAUNCH_OPTIONS}
    missing = [n for n in kernel.arg_names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"{kernel.__name__}: no type or value for {missing}")
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if types.get(name, "").startswith("*") or ints.get(name, 1) % 16 == 0}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget(*HOPPER), options=options)


def usage(compiled) -> Usage:
    """Registers, stack and local (spill) bytes per thread, read off the cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", out))
    return Usage(int(fields["REG"]), int(fields["STACK"]), int(fields["LOCAL"]))


def shrink(tokens: int, group: str, dtype: str, pdl: bool, max_rank: int = 16,
           segments: int = 64, slots: int = 64, one_token: bool = False, tuning=None):
    """The shrink kernel as `TritonSgmv.shrink` would launch it for this shape under `tuning`
    (default: DEFAULT_TUNING; `one_token`: a batch whose every segment is one token)."""
    from kernels import sgmv_triton as st
    from kernels.sgmv_tuning import DEFAULT_TUNING

    hidden, outs = GROUPS[group]
    cols = len(outs) * max_rank
    plan = st.shrink_plan(tuning or DEFAULT_TUNING, one_token, tokens, hidden, cols, max_rank,
                          segments, slots, dtype == "float32", NUM_SMS, pdl)
    p = _POINTER[dtype]
    types = dict(x_ptr=p, a_ptr=p, h_ptr=p, part_ptr="*fp32", lock_ptr="*i32",
                 seg_indptr_ptr="*i32", seg_slots_ptr="*i32", slot_ranks_ptr="*i32",
                 num_segments="i32", num_slots="i32", num_tokens="i32", K="i32",
                 stride_xt="i32", stride_as="i32", stride_ar="i32", stride_ht="i32")
    constants = dict(plan.constants, PRECISION=st._precision(_torch_dtype(dtype)))
    ints = dict(num_segments=segments, num_slots=slots, num_tokens=tokens, K=hidden,
                stride_xt=hidden, stride_as=cols * hidden, stride_ar=hidden, stride_ht=cols)
    return compile_kernel(st._sgmv_shrink_kernel, types, constants, ints), plan


def expand(tokens: int, group: str, dtype: str, pdl: bool, max_rank: int = 16,
           segments: int = 64, slots: int = 64, one_token: bool = False, tuning=None):
    """The expand kernel as `TritonSgmv.expand` would launch it (arguments as for `shrink`)."""
    from kernels import sgmv_triton as st
    from kernels.sgmv_tuning import DEFAULT_TUNING

    offsets = [0]
    for width in GROUPS[group][1]:
        offsets.append(offsets[-1] + width)
    plan = st.expand_plan(tuning or DEFAULT_TUNING, one_token, tokens, tuple(offsets), max_rank,
                          segments, slots, dtype == "float32", NUM_SMS, pdl)
    p = _POINTER[dtype]
    types = dict(h_ptr=p, b_ptr=p, y_ptr=p, seg_indptr_ptr="*i32", seg_slots_ptr="*i32",
                 slot_ranks_ptr="*i32", slot_scalings_ptr="*fp32", num_segments="i32",
                 num_slots="i32", stride_ht="i32", stride_bs="i32", stride_br="i32",
                 stride_yt="i32")
    constants = dict(plan.constants, PRECISION=st._precision(_torch_dtype(dtype)))
    width = offsets[-1]
    cols = (len(offsets) - 1) * max_rank
    ints = dict(num_segments=segments, num_slots=slots, stride_ht=cols,
                stride_bs=width * max_rank, stride_br=width, stride_yt=width)
    return compile_kernel(st._sgmv_expand_kernel, types, constants, ints), plan


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def table_token_counts() -> list[int]:
    """One token count per row of either kernel (each row's bound, 4096 for the open rows)."""
    from kernels.sgmv_tuning import DEFAULT_TUNING as t

    bounds = {r.max_tokens or 4096 for r in t.shrink + t.expand}
    return sorted(bounds | {1})


def kernel_variants(tokens: int, max_rank: int) -> list[tuple[str, bool]]:
    """(kernel, one_token) pairs to compile at a token count and pool rank: each kernel once more
    where batches whose every segment is one token pick another row."""
    from kernels.sgmv_tuning import DEFAULT_TUNING as t

    variants = []
    for kernel, pick in (("shrink", t.shrink_tiling), ("expand", t.expand_tiling)):
        variants.append((kernel, False))
        if pick(tokens, True, max_rank) != pick(tokens, False, max_rank):
            variants.append((kernel, True))
    return variants


# Pool ranks compiled by default: a narrow pool, a rank-16 one and one at WIDE_RANK (its own rows).
MAX_RANKS = (8, 16, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=None,
                    type=lambda v: [int(i) for i in v.split(",")],
                    help="token counts to compile for (default: one per tuning row)")
    ap.add_argument("--dtypes", default="bfloat16,float32", type=lambda v: v.split(","))
    ap.add_argument("--max-ranks", default=MAX_RANKS,
                    type=lambda v: [int(i) for i in v.split(",")],
                    help="pool max ranks to compile for (default: %(default)s)")
    ap.add_argument("--pdl", default="on,off", type=lambda v: [x == "on" for x in v.split(",")],
                    help="programmatic dependent launch: on, off or both (default: %(default)s)")
    ap.add_argument("--groups", default=",".join(GROUPS), type=lambda v: v.split(","))
    args = ap.parse_args()
    combos = [(rank, tokens, dtype, pdl, group)
              for rank in args.max_ranks for tokens in args.tokens or table_token_counts()
              for dtype in args.dtypes for pdl in args.pdl for group in args.groups]
    for rank, tokens, dtype, pdl, group in combos:
        for name, one_token in kernel_variants(tokens, rank):
            build = shrink if name == "shrink" else expand
            compiled, plan = build(tokens, group, dtype, pdl, rank, one_token=one_token)
            u = usage(compiled)
            warps = plan.constants["num_warps"]
            kind = "one-token" if one_token else "any"
            print(f"{name:6} rank {rank:3} tokens {tokens:5} {group:7} {dtype:8} pdl {pdl!s:5} "
                  f"segments {kind:9} regs {u.registers:3} stack {u.stack:3} local {u.local:3} "
                  f"warps {warps} programs/SM {u.programs_per_sm(warps)}",
                  flush=True)


if __name__ == "__main__":
    main()
