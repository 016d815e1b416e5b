"""Block sizes for the Triton SGMV kernels, kept as data.

Each table maps an upper bound on the step's token count to one configuration; the first row
whose bound is at least the token count wins (the last row has no bound). The token count is a
static shape (a CUDA-graph bucket, or a prefill step's size), so the choice never depends on
device values.

Why these rows (H100, bf16, Llama-3-8B shapes):
- Few tokens (decode): memory-bound on the adapter weights, and too few (segment, column block)
  pairs to fill 132 SMs, so the shrink cuts the hidden dimension into `k_per_split` pieces
  (split-K, reduced in a fixed order) and the expand uses narrow column blocks.
- Few tokens: one fused launch per group (`FUSED_TABLE`) instead of a shrink and an expand:
  each (output column block, segment) program recomputes its slice's shrink, so programs never
  wait on one another and there is no split-K reduction. Past the table's last bound (None) a
  step uses the two kernels below.
- Many tokens (prefill): enough tiles without split-K; wider token tiles read each adapter block
  once per 64 tokens, and the shrink's column block spans all fused slices so `x` is read once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShrinkTiling:
    block_m: int  # tokens per tile (tl.dot needs >= 16)
    block_n: int  # output columns (over the n*R fused slices) per tile
    block_k: int  # hidden-dimension step of the inner loop
    k_per_split: int  # hidden elements per split-K piece (>= the hidden size: no split)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # persistent programs launched per SM (work is strided over them)


@dataclass(frozen=True)
class ExpandTiling:
    block_m: int  # tokens per tile
    block_n: int  # output columns per tile (a tile never crosses a slice boundary)
    block_r: int  # rank step of the inner loop (clamped to the pool's max rank, >= 16)
    num_warps: int
    num_stages: int
    programs_per_sm: int


@dataclass(frozen=True)
class FusedTiling:
    block_m: int  # tokens per row tile of a segment (< 16: matrix-vector products, no padding)
    block_k: int  # hidden-dimension step of the recomputed shrink
    block_o: int  # output columns per program
    num_warps: int
    num_stages: int


NO_SPLIT = 1 << 30

# (max tokens or None, tiling), first match wins.
SHRINK_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    (16, ShrinkTiling(16, 64, 256, 256, num_warps=4, num_stages=1, programs_per_sm=8)),
    (128, ShrinkTiling(16, 64, 256, 256, num_warps=4, num_stages=1, programs_per_sm=8)),
    (512, ShrinkTiling(32, 64, 128, 1024, num_warps=4, num_stages=2, programs_per_sm=4)),
    (None, ShrinkTiling(64, 64, 64, 2048, num_warps=4, num_stages=3, programs_per_sm=4)),
)

EXPAND_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    (16, ExpandTiling(16, 128, 128, num_warps=4, num_stages=1, programs_per_sm=16)),
    (128, ExpandTiling(16, 256, 64, num_warps=4, num_stages=1, programs_per_sm=16)),
    (512, ExpandTiling(32, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
    (None, ExpandTiling(64, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
)


# (max tokens, fused tiling or None for the two-kernel path), first match wins. Off until the
# H100 sweep (`bench_sgmv --sweep-fused`) shows a row that beats the two kernels. An earlier fused
# design, whose expand items waited on the same launch's split-K shrink items, measured slower
# everywhere (B=1 50 vs 29 µs per layer; benchmarks/notes_sgmv.md) and was replaced by this one.
FUSED_TABLE: tuple[tuple[int | None, FusedTiling | None], ...] = ((None, None),)


def pick(table, num_tokens: int):
    """The tiling of the first row whose bound covers `num_tokens`."""
    for bound, tiling in table:
        if bound is None or num_tokens <= bound:
            return tiling
    raise ValueError("a tuning table must end with an unbounded row")
