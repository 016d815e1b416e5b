"""Block sizes for the Triton SGMV kernels, kept as data.

Each table maps an upper bound on the step's token count to one configuration; the first row
whose bound is at least the token count wins (the last row has no bound). The token count is a
static shape (a CUDA-graph bucket, or a prefill step's size), so the choice never depends on
device values.

Why these rows (H100, bf16, Llama-3-8B shapes):
- Few tokens (decode): memory-bound on the adapter weights, and too few (segment, column block)
  pairs to fill 132 SMs with whole tiles.
- A tile holding one token (a decode segment) takes matrix-vector products over block_n x
  block_k (shrink) or block_n x the rank (expand); a tile of several tokens takes 16-row tile
  products over tile_k or tile_n at a time, since its operands cost 16 times the registers and
  registers decide how many programs an SM holds (`python -m kernels.aot` reads them off the
  compiled kernels without a GPU).
- Up to 16 tokens, and batches whose every segment is one token up to 128 (decode over
  distinct adapters; `SHRINK_ONE_TOKEN_TABLE`): one-token tiles (block_m 1), no split-K, each
  item a few whole rows of A (`max_a_block` elements: see the one-token rows below) read
  before the kernel waits for the one before it, and h written by the item itself: no
  partials, no arrival counter, no reducer between two kernels. H100,
  2026-11-24, `bench_sgmv --sweep-small` (whole layers) and `--sweep` (shrink alone), us/layer:
  B = 1 14.1 -> 8.8, B = 8 D = 8 23.2 -> 17.3, B = 16 over one adapter 35.4 -> 13.7 (its
  one-token tiles re-read A from L2); shrink at B = D = 64 47.4 -> 39.5, mixed ranks 78.7 ->
  67.9. The same tiling for segments of several tokens past 16 re-reads A once per token:
  B = 128 over one adapter 24 -> 50, over 8 rank-64 adapters 32 -> 204, hence the second table,
  chosen by a static property of the batch the host knows (CUDA graphs capture both variants).
  Handling one-token segments with their own items inside the 16-token-tile kernel lost: that
  kernel's registers (168-212) left the one-token items 3 programs per SM (B = D = 64: 56.9).
- 17-128 tokens with segments of several tokens (batched decode, one adapter shared by many
  requests): the shrink over 16-token tiles of 32 columns and 256-wide hidden steps, split
  512-wide in rank-16 pools and 1024-wide in pools of a wide max rank; up to 32 tokens in
  rank-16 pools, one-token tiles as below 16 (four warps, one row of A per item). Whole layers,
  H100, 2026-11-25, us/layer (split 1024 -> split 512 -> one-token tiles): 32 tokens over one
  adapter 29.8 -> 23.8 -> 20.8, over 8 adapters 36.7 -> 30.3 -> 25.6, over 20 adapters
  (segments 8, 4, 2, 2 and 16 of one) 43.9 -> 41.4 -> 32.3; 64 over one 29.6 -> 25.4, over 8
  35.7 -> 30.6 (one-token tiles 34-36), 128 over one 36.7 -> 30.5; the skewed 64 over 32 loses
  57.3 -> 60.7 (one-token tiles 51.7: no row serves every batch shape there). Wide pools keep
  1024 past 32 tokens: 128 over one rank-128 adapter 72.6 -> 81.3, 64 over 32 at ranks 8-64
  96.7 -> 105; at 17-32 they split 512 (32 over 8 at ranks 8-64 48.0 -> 43.5, one-token tiles
  49.8).
- The expand reads B rank-major ([slots, R, out]): a rank step reads whole rows of the item's
  columns and steps past the slot's rank read nothing, so an item's bytes follow the slot's true
  rank (mixed ranks). A one-token item sums over the rank; Triton spreads a [rank step, block_n]
  tile's columns over threads first, so the sum stays inside each thread only where block_n
  spans every thread (8 x 32 x num_warps columns). Narrower blocks put rank rows on several
  warps and sum through shared memory: `bench_sgmv --sweep --sweep-kernel expand`, H100,
  2026-11-24, expand alone, us/layer, 512 x 16 over 4 warps against 1024 x 16 over 4 (or
  256 x 16 over 1): B = 1 11.8 -> 4.5 (4.3), B = 8 22.2 -> 7.0 (7.3), B = D = 64 54.1 -> 38.3
  (41.8), mixed ranks 8-64 102.3 -> 70.1 (69.3). Tiles of several tokens take tile products
  instead and prefer narrow blocks: B = 64 over 8 adapters 17.2 for 512 x 16 over 4 warps,
  14.6 for 256 over 1, 11.5 for 128 over 1, 33.1 for 1024 over 4. Hence the one-token table's
  1024-wide row for 17-128 tokens and 128-wide tiles on one warp for the other batches there.
  Those batches hold one-token segments too (a skewed decode batch: a few popular adapters
  with several requests each beside many with one), whose tiles take the same block: over 4
  warps their sum over the rank crosses warps. `bench_sgmv --sweep --sweep-cases
  17,18,3,6,8,9 --sweep-kernel expand` (H100, 2026-11-24, expand alone, us/layer), 64 tokens
  over 32 adapters (segments 16, 8, 4, 4, 2 x 4, 1 x 24), rank 16: 65.1 for 128 columns x
  rank steps of 64 (16 in a rank-16 pool) over 4 warps, 29.5 over 1; B = 64 over 8 adapters
  11.2 against 11.3; 128 tokens over one adapter 10.8 against 12.5. Pools of max rank 64 and
  up take the wide-rank row below instead.
  Up to 16
  tokens one-token tiles over 1024 columns serve every batch (`--sweep-small`, whole layers,
  us/layer, against 16-row tiles over 256 columns of 1 warp): B = 1 10.1 (9.7-10.3), B = 8
  15.5 (15.5), 16 tokens over one adapter 15.4 (20.0, its 16-row tiles' products).
- One-token items, `bench_sgmv --sweep --sweep-cases 4,2,1,0` (H100, 2026-11-24, each kernel
  alone over a layer, us/layer, old row -> new): shrink at B = D = 64 mixed ranks 71.8 -> 62.5
  and rank 16 40.3 -> 38.8 (eight rows of a 4,096-wide group per item, 4 programs per SM: fewer,
  larger reads; one row 71.8, two 64.7-72.6, four 63.5-67.2), B = 8 7.8 -> 7.0 and B = 1 5.0 ->
  5.0 (two rows over 8 warps; eight rows there 7.8-9.7 and 5.9-7.5). Expand at B = 8 8.2 -> 7.1
  (2 programs per SM), mixed ranks 71.9 -> 69.7 (rank steps of 32; rank-16 pools clamp the step
  to 16, so their row is unchanged).
- Decode rows (up to 128 tokens) load their weights `evict_first` (`stream_weights`): each
  block is read by one item, or by a few tiles of one segment close together, while x, h and y
  rows serve several items of a token. H100, 2026-11-25, whole layers, us/layer: B = D = 64
  ranks 8-64 129.2 -> 120.1, rank 16 73.9 -> 67.5, B = 8 over 8 adapters 14.0 -> 12.9, B = 1
  9.67 -> 9.32; prefill 4 x 512 227 -> 234, so the prefill rows keep the default.
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
    # At most this many A elements per item (block_n x k_per_split), for rows of one-token tiles
    # (block_m 1) without split-K: a wide hidden size (the down projection's) gets fewer
    # columns per item, so whole rows of A still fit one program's registers. None: block_n.
    max_a_block: int | None = None
    # One-token tiles without split-K: items only for the column blocks below each slot's rank
    # (where the block width divides the pool's max rank), instead of every block of the pool.
    live_items: bool = False
    # Weight loads marked first out of the caches (`evict_first`): for rows whose items each
    # read their block of A once (decode), so streaming A does not evict x and h rows that
    # several items read. Rows whose tiles share A blocks (prefill) keep the default.
    stream_weights: bool = False
    # Tiles' worth of programs launched past the bound on the items (kernels/sgmv_triton.py
    # `_bound_tiles`): each runs its prologue, waits on the kernel before and finds no item.
    spare_tiles: int = 1
    # One-token tiles split over the hidden dimension without a reducer ("the expand sums the
    # partials"): each item takes one k_per_split-wide chunk of it (its block of A read before
    # the kernel waits for the one before, only its chunk of x after), stores its float32
    # partial, and `triton_shrink` returns the partials [S, T, n*R] for the expand to sum as it
    # reads h: no arrival counter, no second round trip. A chunk covering the hidden size: h as
    # without it.
    expand_sums: bool = False
    # The compiler's cap on registers a thread (Triton's `maxnreg`; None: its own choice). Where
    # its choice falls just past a multiple of the register file (134 registers on 4 warps: 3
    # programs an SM), a cap keeps one program more resident. A cap can also raise a kernel the
    # compiler gave fewer (60 -> 72 on one group): rows set it where it was timed.
    max_registers: int | None = None

    def __post_init__(self) -> None:
        _check_tile_step("tile_k", self.tile_k)
        _check_spare_tiles(self.spare_tiles)
        _check_max_registers(self.max_registers)
        if self.live_items and self.block_m != 1:
            raise ValueError("live_items takes one-token tiles (block_m 1)")
        if self.expand_sums and (self.block_m != 1 or self.live_items):
            raise ValueError("expand_sums takes one-token tiles (block_m 1) without live_items")
        if self.expand_sums and self.k_per_split & (self.k_per_split - 1):
            raise ValueError("expand_sums steps through whole chunks: k_per_split must be a "
                             f"power of two, got {self.k_per_split}")
        if self.max_a_block is not None and self.block_m >= 16:
            raise ValueError("max_a_block narrows column blocks below tl.dot's 16 columns: "
                             "only for rows of one-token tiles (block_m < 16)")


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
    # B's loads marked first out of the caches (as ShrinkTiling.stream_weights, for y and h).
    stream_weights: bool = False
    # Under programmatic dependent launch, each thread of a one-token tile waits for its block
    # of B to land before it waits for the kernel before (`_settle` in kernels/sgmv_triton.py).
    settle_weights: bool = False
    # Tiles of one token in a row of several-token tiles (block_m > 1): matrix-vector products
    # over the whole block (True), or the tile products of the others, 15 rows masked (False).
    # A block narrower than 8 x 32 x num_warps columns sums a matrix-vector product over the
    # rank across threads.
    token_products: bool = True
    spare_tiles: int = 1  # as ShrinkTiling.spare_tiles
    # A pool of a max rank below 16 (8, say) steps over the rank that many rows at a time instead
    # of 16 (tile products need 16): a one-token tile's block of B holds no padding rows.
    narrow_rank_steps: bool = False
    max_registers: int | None = None  # as ShrinkTiling.max_registers

    def __post_init__(self) -> None:
        _check_tile_step("tile_n", self.tile_n)
        _check_spare_tiles(self.spare_tiles)
        _check_max_registers(self.max_registers)
        if self.narrow_rank_steps and self.block_m >= 16:
            raise ValueError("narrow_rank_steps takes matrix-vector products (block_m < 16): "
                             "tile products step 16 ranks at least")


def _check_tile_step(name: str, value: int | None) -> None:
    """A tile step must divide the block it steps through (both powers of two) and feed
    `tl.dot`, which needs 16."""
    if value is not None and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two of at least 16, got {value}")


def _check_spare_tiles(value: int) -> None:
    if value < 0:
        raise ValueError(f"spare_tiles must be at least 0, got {value}")


def _check_max_registers(value: int | None) -> None:
    """A thread holds 16 to 255 registers on NVIDIA GPUs since Volta."""
    if value is not None and not 16 <= value <= 255:
        raise ValueError(f"max_registers must be within 16-255 (or None), got {value}")


NO_SPLIT = 1 << 30

# (max tokens or None, tiling), first match wins.
# Whole rows of A per one-token item: up to 16 tokens two rows over 8 warps, for 17-128 eight rows
# of a 4,096-wide group over 8 warps and 2 programs per SM (down: two). `bench_sgmv --sweep
# --sweep-kernel shrink` (H100, 2026-11-24, shrink alone over a layer, us/layer, 4 warps at 4 per
# SM -> 8 at 2): B = D = 64 rank 16 38.2 -> 35.2.
# Up to 16 tokens down takes two rows too (it took one): after the wait every item reads its
# token's row of x, 28 KB for down, from L2, so one row an item read each token's x sixteen times
# at the moment the whole kernel starts at once. A/B in one process (H100, 2026-11-25, whole
# layers, us/layer, one row -> two): one token 8.94 -> 8.83 (rank 16), 8.83 -> 8.60 (rank 8),
# 11.63 -> 11.50 (rank 64); 8 over 8 adapters 13.00 -> 12.68 (rank 16), 10.98 -> 10.91 (rank 8);
# 8 over one adapter 11.61 -> 11.42 (rank 16), 10.34 -> 10.17 (rank 8); four rows 9.28, 13.12,
# 11.83 (registers: fewer programs stay resident ahead of their wait).
_SHRINK_FEW_TOKENS = ShrinkTiling(1, 2, 16384, NO_SPLIT, num_warps=8, num_stages=1,
                                  programs_per_sm=8, max_a_block=32768, stream_weights=True)

# 17-128 tokens with segments of several tokens: 16-token tiles, K split 512-wide in rank-16
# pools (more items for few adapters), 1024-wide in pools of a wide max rank (below).
_SHRINK_TILES = ShrinkTiling(16, 32, 256, 512, num_warps=4, num_stages=3, programs_per_sm=16,
                             tile_k=128, stream_weights=True)

# Spare tiles (`spare_tiles`): one keeps a single token's layer shortest in rank-16 pools, none
# every other batch up to 16 tokens. `bench_sgmv --sweep-latency` (H200, 2026-11-26, whole layers,
# us/layer, shrink and expand spare 1/1 -> 0/0): one token 8.10 -> 8.27 (rank 16), 10.99 -> 10.20
# (rank 64); 8 over 8 adapters 11.84 -> 11.74 (rank 16), 10.36 -> 10.27 (rank 8), 28.97 -> 28.37
# (rank 64); 8 over one adapter 10.84 -> 10.77 (rank 16). Where a tile is many narrow column
# blocks (a rank-64 pool's expand: 448 blocks of 64 columns for gate/up) a spare tile doubles a
# one-token grid, and the next kernel starts only once all of them have.
# A single token's down projection takes its hidden size in two chunks whose sum the expand
# takes (`expand_sums`; the 4,096-wide groups are one chunk, as without it): each item reads half
# of x after the wait. `bench_sgmv --sweep-latency` (H200, 2026-11-26, whole layers, us/layer):
# one token 8.09 -> 7.93 at rank 16; at 8 tokens 11.74 -> 11.81 (8 over 8 adapters), 10.77 ->
# 10.79 (over one), 10.25 -> 10.37 (rank 8), so only one token takes it. Chunks of 1,024-2,048
# with 4-32 rows an item lost everywhere (one token 8.6-19 us/layer).
_FEW_TOKENS_SHRINK_ROWS: tuple[tuple[int | None, ShrinkTiling], ...] = (
    (1, replace(_SHRINK_FEW_TOKENS, block_k=8192, k_per_split=8192, expand_sums=True)),
    (16, replace(_SHRINK_FEW_TOKENS, spare_tiles=0)),
)
SHRINK_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    *_FEW_TOKENS_SHRINK_ROWS,
    (32, replace(_SHRINK_FEW_TOKENS, num_warps=4, max_a_block=4096)),
    (128, _SHRINK_TILES),
    (512, ShrinkTiling(32, 64, 128, 1024, num_warps=4, num_stages=2, programs_per_sm=4)),
    (None, ShrinkTiling(64, 64, 64, 2048, num_warps=4, num_stages=3, programs_per_sm=4)),
)

# Rows for batches whose every segment is one token (decode over distinct adapters), ahead of
# SHRINK_TABLE's: `triton_shrink` searches this table first for such batches, and falls through
# to SHRINK_TABLE's rows past its bounds.
_SHRINK_ONE_TOKEN = ShrinkTiling(1, 16, 16384, NO_SPLIT, num_warps=8, num_stages=1,
                                 programs_per_sm=2, max_a_block=32768, stream_weights=True)
SHRINK_ONE_TOKEN_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    *_FEW_TOKENS_SHRINK_ROWS,
    (128, _SHRINK_ONE_TOKEN),
)

# Tiles of one token over 1024 columns: up to 16 tokens for every batch (no second CUDA graph
# for small buckets; 2 programs per SM), and up to 128 for batches whose every segment is one
# token (4 per SM, rank steps of 32: half the dependent steps of a rank-64 slot).
# Up to 16 tokens their blocks of B land before the wait (`settle_weights`): `bench_sgmv`-style
# A/B in one process (H100, 2026-11-25, whole layers, us/layer, off -> on): one token 9.32 -> 8.95
# at rank 16, 9.30 -> 8.83 at rank 8; 8 over 8 adapters 13.37 -> 13.07 (rank 16), 11.14 -> 10.97
# (rank 8); 8 over one adapter 11.67 -> 11.61 (rank 16), 10.76 -> 10.33 (rank 8). Not in the other
# rows: the same check cost 8 over 8 rank-64 adapters 33.9 -> 36.5, B = D = 64 65.9 -> 69.3 and
# prefill 228 -> 244 (compiled into a kernel, it costs registers where it does not run).
# Up to 16 tokens a pool of max rank 8 takes rank steps of 8 (`narrow_rank_steps`): half the
# block's registers. Same kind of A/B (H100, 2026-11-26, whole layers, us/layer, steps of 16 ->
# 8): one token 8.43 -> 7.98, 8 over one adapter 9.97 -> 9.48, 8 over 8 adapters 10.76 -> 9.96,
# over two (4 + 4) 10.0 -> 9.59, 16 over 16 14.33 -> 13.58. Not past 16 tokens, where the weights'
# bandwidth rules: B = D = 32 21.28 -> 21.74, 64 37.14 -> 38.71, 128 69.94 -> 72.18.
_EXPAND_ONE_TOKEN = ExpandTiling(1, 1024, 16, num_warps=4, num_stages=1, programs_per_sm=2,
                                 stream_weights=True, settle_weights=True,
                                 narrow_rank_steps=True)

_FEW_TOKENS_EXPAND_ROWS: tuple[tuple[int | None, ExpandTiling], ...] = (  # spare tiles: above
    (1, _EXPAND_ONE_TOKEN),
    (16, replace(_EXPAND_ONE_TOKEN, spare_tiles=0)),
)
EXPAND_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    *_FEW_TOKENS_EXPAND_ROWS,
    (128, ExpandTiling(16, 128, 32, num_warps=1, num_stages=1, programs_per_sm=32, tile_n=128,
                       stream_weights=True)),
    (512, ExpandTiling(32, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
    (None, ExpandTiling(64, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8)),
)

# Rows for batches whose every segment is one token, ahead of EXPAND_TABLE's (as for the shrink):
# columns spanning every thread of the program (8 x 32 x 4), so each thread sums its columns over
# the rank alone.
EXPAND_ONE_TOKEN_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    *_FEW_TOKENS_EXPAND_ROWS,
    (128, ExpandTiling(1, 1024, 32, num_warps=4, num_stages=1, programs_per_sm=4,
                       stream_weights=True)),
)


# Pools of a wide max rank (adapters of rank 64 and up). Up to 16 tokens (the expand's up to 128),
# rows for every batch, ahead of the general ones: each item's bytes follow its slot's rank, and a
# rank-64 slot's items are few and heavy, so the shrink reads four rows of A per item over 4 warps
# and the expand narrow column blocks over whole 64-row rank steps on one warp; tiles of several
# tokens (a segment of several requests on one adapter) take 16-row tile products over the same 64
# columns, reading B once, not once per token. `bench_sgmv --sweep --sweep-cases 11,12,13,14` (H100,
# 2026-11-24, each kernel alone over a layer, us/layer, the few-token rows above -> these): B = 8
# over 8 rank-64 adapters shrink 23.6 -> 19.8, expand 27.7 -> 21.5; over ranks 8-64 shrink 12.5 ->
# 11.2, expand 21.5 -> 13.8; one rank-64 token expand 18.0 -> 5.3 (a 1024-column block over four
# rank steps left qkv six items); 8 tokens over one rank-64 adapter shrink 14.8 -> 12.4, expand 19.5
# -> 7.0 (one-token tiles: 12.4). At 17-128 tokens the expand's row is the same, `--sweep
# --sweep-cases 18,8,9 --sweep-kernel expand` (same day, us/layer, 128 columns x rank steps of 64
# over 4 warps -> this): the skewed batch of 64 tokens over 32 adapters at ranks 8-64 82.2 -> 56.9
# (its one-token tiles sum their rank within a warp), 128 tokens over one rank-128 adapter 29.4 ->
# 34.4, 4 x 32 tokens 37.1 -> 41.2. Where every segment is one token the expand keeps one-token
# tiles, which hold fewer registers: 8 over 8 rank-64 adapters 21.5 (16-token tiles 21.9), over
# ranks 8-64 13.8 (14.1), one rank-64 token 5.3 (5.8). A 4-warp tile over 128 columns takes 8 tokens
# over one adapter to 6.3, but a one-token tile beside them in a batch would sum its rank across
# warps (25 us/layer for one-token tiles there).
# At 17-128 tokens, for batches whose every segment is one token, the shrink's items cover only the
# column blocks below each slot's rank (`live_items`): in a pool of max rank 64 a rank-8 token
# otherwise takes eight blocks of a slice where one is live, and the programs' strides over the
# items meet the empty ones unevenly. B = D = 64 over ranks 8-64, same run: 62.2 (table row) -> 67.8
# (8 warps at 2 per SM) -> 58.9 (the same with live items); at rank 16, where no block is empty,
# live items cost 35.2 -> 35.8, so only the wide-rank table takes them.
# Up to 16 tokens the compiler's registers are capped at 128 (`max_registers`): its own choice for
# the down projection, 134 on 4 warps, left 3 programs an SM, and segments of several tokens run
# their one-token items in waves (8 tokens over one adapter: 512 items). Whole layers
# (`time_pairs`, H100, 2026-11-26, us/layer, medians of three interleaved runs, no cap -> 128 ->
# 112): 8 tokens over one rank-64 adapter 18.77 -> 18.06 -> 18.37, over two (4 + 4) 21.53 -> 20.46
# -> 20.24, skewed 8 over 7 32.76 -> 32.30 -> 32.32, 16 over one 29.84 -> 28.31 -> 27.84. Batches
# whose every segment is one token keep their own row uncapped: there the cap lost 0.1-0.2 (8
# over 8 adapters 32.94 -> 33.09, ranks 8-64 21.28 -> 21.39, 16 over 16 59.90 -> 60.11).
WIDE_RANK = 64
_SHRINK_WIDE_FEW_TOKENS: tuple[tuple[int | None, ShrinkTiling], ...] = (
    (1, replace(_SHRINK_FEW_TOKENS, spare_tiles=0)),  # spare tiles: see SHRINK_TABLE
    (16, ShrinkTiling(1, 16, 16384, NO_SPLIT, num_warps=4, num_stages=1, programs_per_sm=4,
                      max_a_block=16384, stream_weights=True, spare_tiles=0, max_registers=128)),
)
SHRINK_WIDE_RANK_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    *_SHRINK_WIDE_FEW_TOKENS,
    (32, _SHRINK_TILES),
    (128, replace(_SHRINK_TILES, k_per_split=1024)),
)
# Up to 8 tokens the expand's tiles take 128 columns over 4 warps, one-token tiles too in tile
# products (`token_products` off: their matrix-vector product would sum the rank across warps).
# Whole layers (`bench_sgmv`'s `time_pairs`, H100, 2026-11-26, us/layer, the 128-row -> this):
# 8 tokens over one rank-64 adapter 19.90 -> 18.51, over two (4 + 4) 21.77 -> 21.24, a skewed
# 8 over 7 (2 + six of one) 32.79 -> 32.79 (39.61 with one-token products); at 16 tokens no gain
# (16 over one 30.23 -> 30.15, over 4 36.98 -> 37.14, skewed 16 over 15 63.77 -> 65.75).
# (a one-token table of a kind comes first for its batches, so it repeats the rows it shares)
EXPAND_WIDE_RANK_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    (8, ExpandTiling(16, 128, 64, num_warps=4, num_stages=1, programs_per_sm=8, tile_n=128,
                     stream_weights=True, token_products=False, spare_tiles=0)),
    (128, ExpandTiling(16, 64, 64, num_warps=1, num_stages=1, programs_per_sm=32, tile_n=64,
                       stream_weights=True)),
)
# Up to 16 one-token segments in a wide pool: the down projection in 8,192-wide chunks of two
# rows of A an item, the sum left to the expand (`expand_sums`); the 4,096-wide groups four whole
# rows an item, as the row before. Same sweep, us/layer: 8 over 8 rank-64 adapters 28.59
# -> 28.05, over ranks 8-64 20.84 -> 20.33; not for a single token (10.28 -> 11.51) nor for
# segments of several tokens (8 over one rank-64 adapter 18.82 -> 19.69).
SHRINK_WIDE_RANK_ONE_TOKEN_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    _SHRINK_WIDE_FEW_TOKENS[0],
    (16, replace(_SHRINK_WIDE_FEW_TOKENS[1][1], block_n=4, block_k=8192, k_per_split=8192,
                 expand_sums=True, max_registers=None)),
    (128, replace(_SHRINK_ONE_TOKEN, live_items=True)),
)
EXPAND_WIDE_RANK_ONE_TOKEN_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = (
    (16, ExpandTiling(1, 64, 64, num_warps=1, num_stages=1, programs_per_sm=32, tile_n=64,
                      stream_weights=True, spare_tiles=0)),
)


# Pools of a narrow max rank (8 and below). Up to 8 tokens, rows for every batch ahead of all the
# others (a single token keeps its row): items of the shrink take one row of A over 16 warps
# where a hidden size is too wide for two in `max_a_block` (the down projection: 64 items at 8
# tokens of rank 8, fewer than the SMs), two over 16 warps elsewhere. Whole layers, H100,
# 2026-11-26, us/layer, medians of three interleaved runs, the rows before -> this one: 8 over 8
# rank-8 adapters 9.90 -> 9.68, 8 over one 9.43 -> 9.32, over two (4 + 4) 9.54 -> 9.39, skewed 8
# over 7 (2 + six of one) 9.87 -> 9.72. Not past 8 tokens (16 over 16, the down group alone on
# it: 13.56 -> 13.82), nor for a single token, whose row sums two chunks in the expand (8.13 ->
# 8.20), nor in rank-16 pools (8 over 8 adapters, the down group alone: 12.63 -> 12.99).
NARROW_RANK = 8
SHRINK_NARROW_RANK_TABLE: tuple[tuple[int | None, ShrinkTiling], ...] = (
    _FEW_TOKENS_SHRINK_ROWS[0],
    (8, replace(_FEW_TOKENS_SHRINK_ROWS[1][1], num_warps=16, max_a_block=16384)),
)
EXPAND_NARROW_RANK_TABLE: tuple[tuple[int | None, ExpandTiling], ...] = ()


# Each kernel's tables are named {SHRINK,EXPAND}_{name} for these names (tools swap them all).
TABLE_NAMES = ("TABLE", "ONE_TOKEN_TABLE", "WIDE_RANK_TABLE", "WIDE_RANK_ONE_TOKEN_TABLE",
               "NARROW_RANK_TABLE")


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
