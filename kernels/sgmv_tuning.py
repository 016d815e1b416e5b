"""Block sizes for the Triton SGMV kernels, kept as data.

Each table maps an upper bound on the step's token count to one configuration; the first row
whose bound is at least the token count wins (the last row has no bound). The token count is a
static shape (a CUDA-graph bucket, or a prefill step's size), so the choice never depends on
device values.

Why these rows (H100, bf16, Llama-3-8B shapes):
- Few tokens (decode): memory-bound on the adapter weights, and too few (segment, column block)
  pairs to fill 132 SMs, so the shrink cuts the hidden dimension into `k_per_split` pieces
  (split-K, reduced in a fixed order) and the expand uses narrow column blocks.
- A tile holding one token (a decode segment) takes matrix-vector products over block_n x
  block_k (shrink) or block_n x the rank (expand); a tile of several tokens takes 16-row tile
  products over tile_k or tile_n at a time, since its operands cost 16 times the registers and
  registers decide how many programs an SM holds (`python -m kernels.aot` reads them off the
  compiled kernels without a GPU). The 16-row product for one live token carried 15 dead rows
  through the layout changes and the epilogue: 156 registers, 3 programs per SM, where the
  one-token expand needs 128 and holds 4.
- Up to 16 tokens under programmatic dependent launch, where a split's A block is read before
  the kernel waits for the one before it (`bench_sgmv --sweep-small`, H100, 2026-11-24, whole
  layers over (shrink, expand) pairs): one-token products over 16 columns and K splits of 1024
  took B = 1 to 14.0 us/layer (was 14.8) and B = 8 to 22.5 (was 26.3).
- 17-128 tokens (batched decode), `bench_sgmv --sweep`, H100, 2026-11-24, us/layer: at
  B = D = 64 rank 16, the shrink over 32 columns and 256-wide hidden steps, split 1024-wide,
  47.3 (the 16-row tiling 52.4) and the expand over 512 columns 46.5 (71.1). At B = 64 over 8
  adapters (8-token tiles) tile steps of 128 columns and hidden 128 cost 27.8 + 21.9, against
  ~24 + 13 for wide 16-row tiles alone: wider tile steps (tile_n 512) raise the kernel's
  registers and cost B = D = 64 5 us in the expand (51.3 against 46.4). The decode step with 64
  distinct adapters is the target, so the rows favour it.
- The same row in a pool of max rank 64 (the mixed-rank case, ranks 8-64): `max_tile` keeps
  block_n x the rank step at 8,192 elements, so rank-16 pools step 512 x 16 and rank-64 pools
  128 x 64 (a rank step of 16 made the expand 329 us/layer, a 512 x 64 tile spilled).
- Many tokens (prefill): enough tiles without split-K; wider token tiles read each adapter block
  once per 64 tokens, and the shrink's column block spans all fused slices so `x` is read once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ShrinkTiling:
    block_m: int  # tokens per tile (tl.dot needs >= 16; fewer: matrix-vector products)
    block_n: int  # output columns (over the n*R fused slices) per tile
    block_k: int  # hidden-dimension step of the inner loop
    k_per_split: int  # hidden elements per split-K piece (>= the hidden size: no split)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # persistent programs launched per SM (work is strided over them)
    # Hidden step for tiles of several tokens, a power of two (None: block_k); tiles of one
    # token step block_k at a time.
    tile_k: int | None = None

    def __post_init__(self) -> None:
        _check_tile_step("tile_k", self.tile_k)


@dataclass(frozen=True)
class ExpandTiling:
    block_m: int  # tokens per tile
    block_n: int  # output columns per tile (a tile never crosses a slice boundary)
    block_r: int  # rank step of the inner loop (clamped to the pool's max rank, >= 16)
    num_warps: int
    num_stages: int
    programs_per_sm: int
    # At most this many B elements per tile (block_n x the rank step): pools of a larger max
    # rank take wider rank steps over narrower column blocks. None: block_n as given.
    max_tile: int | None = None
    # Columns per tile product for tiles of several tokens, a power of two (None: block_n);
    # tiles of one token take the whole block in one matrix-vector product.
    tile_n: int | None = None

    def __post_init__(self) -> None:
        _check_tile_step("tile_n", self.tile_n)


def _check_tile_step(name: str, value: int | None) -> None:
    """A tile step must divide the block it steps through (both powers of two) and feed
    `tl.dot`, which needs 16."""
    if value is not None and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two of at least 16, got {value}")


NO_SPLIT = 1 << 30

# (max tokens or None, tiling), first match wins.
SHRINK_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    (16, ShrinkTiling(16, 16, 1024, 1024, num_warps=4, num_stages=1, programs_per_sm=8,
                      tile_k=128)),
    (128, ShrinkTiling(16, 32, 256, 1024, num_warps=4, num_stages=3, programs_per_sm=16,
                       tile_k=128)),
    (512, ShrinkTiling(32, 64, 128, 1024, num_warps=4, num_stages=2, programs_per_sm=4)),
    (None, ShrinkTiling(64, 64, 64, 2048, num_warps=4, num_stages=3, programs_per_sm=4)),
)

EXPAND_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    (16, ExpandTiling(16, 128, 128, num_warps=4, num_stages=1, programs_per_sm=16)),
    (128, ExpandTiling(16, 512, 64, num_warps=4, num_stages=1, programs_per_sm=16,
                       max_tile=8192, tile_n=128)),
    (512, ExpandTiling(32, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
    (None, ExpandTiling(64, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
)


# float32 is the checking dtype (the GPU tests compare it token for token with PEFT). Its products
# run in IEEE float32 on CUDA cores, where Triton unrolls a whole tile product into scalar FMAs;
# at the bf16 tile sizes the float32 engine's warm-up sat in an SGMV launch for minutes on an
# H100. Its tiles are capped to these.
FLOAT32_CAPS = {"block_m": 16, "block_n": 32, "block_k": 32, "block_r": 16}


def pick(table, num_tokens: int, float32: bool = False):
    """The tiling of the first row whose bound covers `num_tokens` (capped for float32)."""
    for bound, tiling in table:
        if bound is None or num_tokens <= bound:
            if not float32:
                return tiling
            caps = {f.name: min(getattr(tiling, f.name), FLOAT32_CAPS[f.name])
                    for f in fields(tiling) if f.name in FLOAT32_CAPS}
            return replace(tiling, **caps)
    raise ValueError("a tuning table must end with an unbounded row")
