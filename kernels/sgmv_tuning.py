"""Block sizes of the Triton SGMV kernels, as one frozen object (`SgmvTuning`).

The LoRA weight pool owns a tuning and hands it to the Triton backend; a benchmark builds its own
(`dataclasses.replace(DEFAULT_TUNING, pdl=False)`). Each kernel has rows; the first that serves a
batch wins, by three static facts the host knows: the token count, whether every segment is one
token (decode over distinct adapters) and the pool's max rank. Speed only: every row computes
every batch. A row stays only where it is worth 1% of the step it serves; decode rows stream
their weights. What each row was kept for, with its figure and the commands:
docs/perf/sgmv_tuning.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Generic, TypeVar

NO_SPLIT = 1 << 30  # k_per_split past any hidden size: no split-K
WIDE_RANK = 64  # pools of adapters of rank 64 and up


@dataclass(frozen=True)
class ShrinkTiling:
    block_m: int  # tokens per tile (tl.dot needs >= 16; 1: matrix-vector products)
    block_n: int  # columns of h (over the n*R fused slices) per item
    block_k: int  # hidden step of the inner loop
    k_per_split: int  # hidden elements per split-K piece (NO_SPLIT: none)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # persistent programs launched per SM
    max_a_block: int | None = None  # A elements an item holds at most (down: fewer columns)
    stream_weights: bool = False  # A's loads `evict_first`: each block is read by one item
    # One-token tiles without split-K: items only for the column blocks below each slot's rank
    # (where block_n divides the pool's max rank), not every block up to the max rank.
    live_items: bool = False

    def __post_init__(self) -> None:
        if self.live_items and self.block_m != 1:
            raise ValueError("live_items takes one-token tiles (block_m 1)")


@dataclass(frozen=True)
class ExpandTiling:
    block_m: int  # tokens per tile
    block_n: int  # output columns per item (never across a slice boundary)
    block_r: int  # rank step of the inner loop (clamped to the pool's max rank, >= 16)
    num_warps: int
    num_stages: int
    programs_per_sm: int
    stream_weights: bool = False  # B's loads `evict_first`


T = TypeVar("T", ShrinkTiling, ExpandTiling)


@dataclass(frozen=True)
class Row(Generic[T]):
    """A tiling for batches of at most `max_tokens` tokens (None: any), whose every segment is one
    token where `one_token_segments`, in pools of a max rank of at least `min_max_rank`."""

    tiling: T
    max_tokens: int | None
    one_token_segments: bool = False
    min_max_rank: int = 0

    def serves(self, num_tokens: int, one_token_segments: bool, max_rank: int) -> bool:
        return ((self.max_tokens is None or num_tokens <= self.max_tokens)
                and (one_token_segments or not self.one_token_segments)
                and max_rank >= self.min_max_rank)


# float32 (the checking dtype) unrolls into scalar FMAs: at bf16 sizes it compiled for minutes.
FLOAT32_CAPS = {"block_m": 16, "block_n": 32, "block_k": 32, "block_r": 16}


@dataclass(frozen=True)
class SgmvTuning:
    """Each kernel's rows (the last serves every batch), programmatic dependent launch where the
    GPU supports it, launches that skip Triton's dispatch. Hashed once: plans are memoized by it."""

    shrink: tuple[Row[ShrinkTiling], ...]
    expand: tuple[Row[ExpandTiling], ...]
    pdl: bool = True
    cached_launches: bool = True

    def __post_init__(self) -> None:
        if not all(rows and rows[-1].serves(1 << 62, False, 0)
                   for rows in (self.shrink, self.expand)):
            raise ValueError("a kernel's last row must serve every batch")

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def shrink_tiling(self, num_tokens: int, one_token_segments: bool, max_rank: int,
                      float32: bool = False) -> ShrinkTiling:
        return _pick(self.shrink, num_tokens, one_token_segments, max_rank, float32)

    def expand_tiling(self, num_tokens: int, one_token_segments: bool, max_rank: int,
                      float32: bool = False) -> ExpandTiling:
        return _pick(self.expand, num_tokens, one_token_segments, max_rank, float32)

    def one_token_variant_differs(self, num_tokens: int, max_rank: int) -> bool:
        """Whether batches whose every segment is one token take other tilings (a CUDA graph
        of `num_tokens` then needs a variant for each)."""
        return any(pick(num_tokens, True, max_rank) != pick(num_tokens, False, max_rank)
                   for pick in (self.shrink_tiling, self.expand_tiling))


def _pick(rows: tuple, num_tokens: int, one_token_segments: bool, max_rank: int,
          float32: bool):
    tiling = next(r.tiling for r in rows if r.serves(num_tokens, one_token_segments, max_rank))
    if not float32:
        return tiling
    return replace(tiling, **{f.name: min(getattr(tiling, f.name), FLOAT32_CAPS[f.name])
                              for f in fields(tiling) if f.name in FLOAT32_CAPS})


_F, _E = ShrinkTiling, ExpandTiling  # positional: block_m, block_n, block_k | block_r, ...
_FEW = _F(1, 2, 16384, NO_SPLIT, 8, 1, 8, stream_weights=True)  # two whole rows of A an item
_TILES = _F(16, 32, 128, 512, 4, 3, 16, stream_weights=True)  # 16-token tiles, split 512-wide
_ONE = _F(1, 16, 16384, NO_SPLIT, 8, 1, 2, 32768, True)  # eight whole rows of A an item
_WIDE_E = _E(16, 64, 64, 1, 1, 32, stream_weights=True)  # narrow blocks, 64-row rank steps
_FEW_E = _E(1, 1024, 16, 4, 1, 2, stream_weights=True)  # one-token tiles over 1024 columns

# One line per row: the batches it serves and what it does for them (the figure it was kept for:
# docs/perf/sgmv_tuning.md)
DEFAULT_TUNING = SgmvTuning(
    shrink=(
        Row(_FEW, 1),  # one token (as 2-16, ahead of the wide pools' row)
        # wide pools 2-16: four rows an item over 4 warps
        Row(_F(1, 16, 16384, NO_SPLIT, 4, 1, 4, 16384, True), 16, min_max_rank=WIDE_RANK),
        Row(_FEW, 16),  # 2-16 tokens: one-token tiles
        # wide pools, 17-128 one-token segments: items only below each slot's rank (mixed ranks
        # cost their true rank)
        Row(replace(_ONE, live_items=True), 128, one_token_segments=True, min_max_rank=WIDE_RANK),
        # 17-128 one-token segments: eight rows an item
        Row(_ONE, 128, one_token_segments=True),
        Row(_TILES, 32, min_max_rank=WIDE_RANK),  # wide pools 17-32: 16-token tiles
        # 17-32 tokens: one-token tiles
        Row(replace(_FEW, num_warps=4, max_a_block=4096), 32),
        # wide pools 33-128: 1024-wide splits
        Row(replace(_TILES, k_per_split=1024), 128, min_max_rank=WIDE_RANK),
        Row(_TILES, 128),  # 33-128 tokens: 16-token tiles
        # prefill up to 512: 32-token tiles split 1024-wide, enough items for every SM
        Row(_F(32, 64, 128, 1024, 4, 2, 4), 512),
        # prefill: 64-token tiles read each block of A once per 64 tokens
        Row(_F(64, 64, 64, 2048, 4, 3, 4), None),
    ),
    expand=(
        Row(_WIDE_E, 16, min_max_rank=WIDE_RANK),  # wide pools up to 16 tokens
        Row(_FEW_E, 16),  # up to 16 tokens: one-token tiles
        # 17-128 one-token segments: rank steps of 32, 4 per SM
        Row(replace(_FEW_E, block_r=32, programs_per_sm=4), 128, one_token_segments=True),
        Row(_WIDE_E, 128, min_max_rank=WIDE_RANK),  # wide pools 17-128 tokens
        # 17-128 tokens: 16-token tiles over 128 columns on one warp
        Row(_E(16, 128, 32, 1, 1, 32, stream_weights=True), 128),
        Row(_E(32, 128, 64, 4, 1, 8), 512),  # prefill up to 512: 32-token tiles
        Row(_E(64, 128, 64, 4, 1, 8), None),  # prefill: each B block read once per 64 tokens
    ),
)
