"""SGMV shrink and expand in Triton (contract and torch reference: kernels/sgmv.py).

Both kernels are persistent: the grid is a static bound (`programs_per_sm` x SMs, or fewer when
the batch is small), and every program strides over a work list whose length it computes from the
device metadata. The work list is made of token tiles: segment s owns ceil(len_s / BLOCK_M) tiles,
numbered in segment order (a prefix sum over `seg_indptr`, computed by every program in its
prologue). Base-model tokens belong to no segment, so they own no tile and cost nothing; padding
segments of length 0 own no tile either. The grid depends only on static shapes (token count,
segment count, widths, SM count), never on device values, so a launch can be captured in a CUDA
graph and replayed over new metadata. The launchers never read device tensors.

Shrink, h[t, i*R + r] = x[t] . A[slot, i*R + r]: a work item is (tile, column block over the n*R
fused columns, K split). Columns whose rank index r is past the slot's true rank are masked out of
every load, so a rank-8 slot reads 8 rows of A per slice, not R; a column block with no live column
writes zeros and reads nothing (a `live_items` row makes none: a token's items are the blocks below
its slot's rank, and h past the rank is left unwritten). With split-K, each split writes a float32
partial; the split that arrives last (an arrival counter per tile and column block) sums all
partials in split order and writes h. The counter only elects the reducer: the sum is the same
fixed-order sum whichever split finishes last, so results are deterministic and no atomic touches a
value. The reducer resets its counter to 0, so counters are zero between launches.

Expand, y[t, o_i + c] += scale * h[t, i*R : i*R + rank] . B[slot, :rank, o_i + c]: a work item
is (tile, column block); column blocks never cross a slice boundary, so slices of different
widths (GQA q/k/v) are one launch. B is rank-major: each rank step reads whole rows of the
block's columns, and rows past the slot's true rank are not read, so an item's bytes follow the
slot's rank. Each y element is read, updated and written by exactly one program:
deterministic, no atomics.

A tile of one token (every decode segment) takes matrix-vector products; a tile of several takes
16-row tile products (`tl.dot`). The choice is made per tile on the device, so one launch serves
both; the tuning row (kernels/sgmv_tuning.py) sizes each path.

Programmatic dependent launch (Hopper and later, `SgmvTuning.pdl`): a kernel may start while the
one before it on the stream still runs. Each SGMV kernel lets the next one start at once
(`gdc_launch_dependents`), reads only what no earlier kernel writes (the segment table, slot ranks
and scalings, adapter weights) before `gdc_wait`, which returns once the kernel before has finished
and its writes are visible, and every program waits before it ends, so a kernel never finishes
before the one it follows. Adapter weights are written on the load stream, ordered before the step
by events. The overlap hides the launch, the metadata round trip and the first weight read.
A shrink item of one hidden step then reads its A block before the wait (PRELOAD_A), and Triton
lays that product out for another reduction tree than without PDL: the float32 sums round in
another order, so results match plain launches to rounding (an h entry in thousands one bf16
step apart), and match bit for bit the same launches without overlap.

Rows of h for tokens outside every segment are unspecified (never written); the expand never
reads them and never touches those rows of y. Inputs are float32, float16 or bfloat16;
accumulation is float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # an older Triton: never launched with PDL, so these are never reached
    _HAVE_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

from kernels.launch import CachedLaunch, cdiv, next_pow2
from kernels.sgmv import SgmvBackend, SgmvBatch
from kernels.sgmv_tuning import DEFAULT_TUNING, SgmvTuning

MAX_SLICES = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_SMS = 1  # CPU (Triton's interpreter): few programs, each striding over many items
_LOCK_MIN = 1 << 16  # int32 arrival counters allocated at first use, per device


@triton.jit
def _segment_table(seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_S: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """Per segment [BLOCK_S]: start, end, slot, tiles and the inclusive prefix sum of tiles.
    Loaded once per program, so finding a tile's segment later costs no memory access."""
    s = tl.arange(0, BLOCK_S)
    live = s < num_segments
    starts = tl.load(seg_indptr_ptr + s, mask=live, other=0)
    ends = tl.load(seg_indptr_ptr + s + 1, mask=live, other=0)
    slots = tl.load(seg_slots_ptr + s, mask=live, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return starts, ends, slots, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def _locate_item(i, starts, ends, slots, counts, counts_incl):
    """Item i among per-segment item counts (inclusive prefix sum `counts_incl`): its segment's
    first row, end row and slot, and the item's index within the segment."""
    owner = (counts_incl > i) & (counts_incl - counts <= i)  # one segment; empty ones never match
    # Four sums rather than one reduction over a tuple: the same shuffles compiled, and Triton's
    # interpreter runs builtin sums in numpy but a custom combine element by element in Python.
    start = tl.sum(tl.where(owner, starts, 0), axis=0)
    end = tl.sum(tl.where(owner, ends, 0), axis=0)
    slot = tl.sum(tl.where(owner, slots, 0), axis=0)
    before = tl.sum(tl.where(owner, counts_incl - counts, 0), axis=0)
    return start, end, slot, i - before


@triton.jit
def _locate_tile(j, starts, ends, slots, tiles, tiles_incl, BLOCK_M: tl.constexpr):
    """Tile j's first row, its segment's end row, and the segment's slot."""
    start, end, slot, local = _locate_item(j, starts, ends, slots, tiles, tiles_incl)
    return start + local * BLOCK_M, end, slot


@triton.jit
def _slot_value(slot, slot_ids, values):
    """values[slot] for a table held in registers (slot_ids = arange over the slots)."""
    return tl.sum(tl.where(slot_ids == slot, values, 0), axis=0)


@triton.jit
def _slice_columns(nb, O_1, O_2, O_3, O_4, NB_1, NB_2, NB_3, BLOCK_N: tl.constexpr):
    """Output column block nb -> its slice index, its first column and the slice's end."""
    sl = (nb >= NB_1).to(tl.int32) + (nb >= NB_2).to(tl.int32) + (nb >= NB_3).to(tl.int32)
    o_lo = tl.where(sl == 0, 0, tl.where(sl == 1, O_1, tl.where(sl == 2, O_2, O_3)))
    o_hi = tl.where(sl == 0, O_1, tl.where(sl == 1, O_2, tl.where(sl == 2, O_3, O_4)))
    nb_lo = tl.where(sl == 0, 0, tl.where(sl == 1, NB_1, tl.where(sl == 2, NB_2, NB_3)))
    return sl, o_lo + (nb - nb_lo) * BLOCK_N, o_hi


@triton.jit
def _product(u, v, acc, PRECISION: tl.constexpr):
    """acc [M, N] + u [M, K] @ v [N, K]^T in float32. Tensor cores need M >= 16; one token
    (M = 1) takes a matrix-vector product instead, with no rows wasted on padding."""
    if u.shape[0] >= 16:
        return tl.dot(u, tl.trans(v), acc, input_precision=PRECISION)
    if u.shape[0] == 1:  # two dimensions: u's row broadcasts over v's rows
        return acc + tl.sum(v.to(tl.float32) * u.to(tl.float32), axis=1)[None, :]
    return acc + tl.sum(u.to(tl.float32)[:, None, :] * v.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _product_kn(u, v, acc, PRECISION: tl.constexpr):
    """acc [M, N] + u [M, K] @ v [K, N] in float32 (`_product` with v untransposed)."""
    if u.shape[0] >= 16:
        return tl.dot(u, v, acc, input_precision=PRECISION)
    return acc + tl.sum(u.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _shrink_acc(x_ptrs, a_ptrs, row_mask, a_mask, acc, k_lo, k_hi, K,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                WEIGHT_EVICT: tl.constexpr):
    """acc [M, N] + x[rows, k_lo:k_hi] @ A[cols, k_lo:k_hi]^T, in float32. `x_ptrs` [M, BLOCK_K]
    and `a_ptrs` [N, BLOCK_K] point at hidden index 0; rows/columns outside the masks load
    nothing."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs + k0, mask=row_mask[:, None], other=0.0)
            av = tl.load(a_ptrs + k0, mask=a_mask[:, None], other=0.0,
                         eviction_policy=WEIGHT_EVICT)
        else:
            k_in = (k0 + offs_k) < K
            xv = tl.load(x_ptrs + k0, mask=row_mask[:, None] & k_in[None, :], other=0.0)
            av = tl.load(a_ptrs + k0, mask=a_mask[:, None] & k_in[None, :], other=0.0,
                         eviction_policy=WEIGHT_EVICT)
        acc = _product(xv, av, acc, PRECISION)
    return acc


@triton.jit
def _shrink_token(x_ptr, a_ptr, row, slot, cols, col_live, k_lo, k_hi, K, stride_xt,
                  stride_as, stride_ar, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, PDL: tl.constexpr, PRELOAD_A: tl.constexpr,
                  WEIGHT_EVICT: tl.constexpr):
    """h[row, cols] (or its split-K partial over hidden [k_lo, k_hi)) for one token: a
    matrix-vector product over x's row, BLOCK_K at a time; columns outside `col_live` read
    nothing. With PRELOAD_A the range is one step, and its A block is read before `gdc_wait`."""
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + slot * stride_as + cols[:, None] * stride_ar + offs_k[None, :]  # [N, K]
    x_row = x_ptr + row * stride_xt + offs_k[None, :]  # [1, K]
    acc = tl.zeros((1, cols.shape[0]), dtype=tl.float32)
    if PRELOAD_A:
        k_in = (k_lo + offs_k < K) | EVEN_K
        av = tl.load(a_rows + k_lo, mask=col_live[:, None] & k_in[None, :], other=0.0,
                     eviction_policy=WEIGHT_EVICT)
        gdc_wait()
        xv = tl.load(x_row + k_lo, mask=k_in[None, :], other=0.0)
        acc = _product(xv, av, acc, PRECISION)
    else:
        if PDL:
            gdc_wait()
        acc = _shrink_acc(x_row, a_rows, tl.arange(0, 1) < 1, col_live, acc, k_lo, k_hi, K,
                          BLOCK_K, EVEN_K, PRECISION, WEIGHT_EVICT)
    return acc


@triton.jit
def _shrink_tile(x_ptr, a_ptr, h_ptr, part_ptr, lock_ptr, first_row, end_row, slot, rank, j,
                 cb, ks, num_tokens, K, stride_xt, stride_as, stride_ar, stride_ht,
                 MAX_RANK: tl.constexpr, NUM_COLS: tl.constexpr, NUM_CB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, PDL: tl.constexpr, PRELOAD_A: tl.constexpr,
                 WEIGHT_EVICT: tl.constexpr):
    """Work item (tile j, column block cb, K split ks): h for the tile's rows and the block's
    columns; with split-K, this split's partial, and the sum of all if it arrives last."""
    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < end_row
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < NUM_COLS
    col_live = col_in & ((cols % MAX_RANK) < rank)  # rank index within its slice
    out_mask = row_mask[:, None] & col_in[None, :]
    h_ptrs = h_ptr + rows[:, None] * stride_ht + cols[None, :]

    if tl.sum(col_live.to(tl.int32), axis=0) > 0:
        k_lo = ks * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_M > 1 and end_row - first_row > 1:  # several tokens: tile products
            if PDL:
                gdc_wait()
            offs_k = tl.arange(0, BLOCK_K)
            a_rows = a_ptr + slot * stride_as + cols[:, None] * stride_ar + offs_k[None, :]
            x_tile = x_ptr + rows[:, None] * stride_xt + offs_k[None, :]
            acc = _shrink_acc(x_tile, a_rows, row_mask, col_live, acc, k_lo, k_hi, K, BLOCK_K,
                              EVEN_K, PRECISION, WEIGHT_EVICT)
        else:
            acc += _shrink_token(x_ptr, a_ptr, first_row.to(tl.int64), slot, cols, col_live,
                                 k_lo, k_hi, K, stride_xt, stride_as, stride_ar, BLOCK_K,
                                 EVEN_K, PRECISION, PDL, PRELOAD_A, WEIGHT_EVICT)

        if SPLIT_K == 1:
            tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=out_mask)
        else:
            part_rows = rows[:, None] * NUM_COLS + cols[None, :]
            split_stride = num_tokens * NUM_COLS
            tl.store(part_ptr + ks * split_stride + part_rows, acc, mask=out_mask)
            # Every thread's partial is stored before the (release) arrival is counted.
            tl.debug_barrier()
            lock = lock_ptr + j * NUM_CB + cb
            arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # last split: sum all partials in split order
                tl.debug_barrier()
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # unrolled: every load in flight at once
                    total += tl.load(part_ptr + s * split_stride + part_rows, mask=out_mask,
                                     other=0.0, cache_modifier=".cg")  # other SMs wrote these
                tl.store(h_ptrs, total.to(h_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
    elif ks == 0:  # every column past the slot's rank: zeros, no weights read
        if PDL:
            gdc_wait()
        tl.store(h_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _shrink_live_items(x_ptr, a_ptr, h_ptr, slot_ranks_ptr, starts, ends, slots, slot_ids,
                       slot_ranks, num_tokens, K, stride_xt, stride_as, stride_ar, stride_ht,
                       MAX_RANK: tl.constexpr, NUM_COLS: tl.constexpr, NUM_CB: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                       EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                       PRELOAD_A: tl.constexpr, WEIGHT_EVICT: tl.constexpr):
    """The shrink over one-token tiles without split-K, with items only for the column blocks
    below each slot's rank (BLOCK_N divides MAX_RANK): a low-rank token in a wide pool leaves no
    empty items in the programs' strides. h past a slot's rank is left unwritten."""
    num_slices: tl.constexpr = NUM_COLS // MAX_RANK
    per_slice: tl.constexpr = MAX_RANK // BLOCK_N
    # Slot ranks are written by no kernel before this one: gathered per segment before the wait.
    seg_blocks = (tl.load(slot_ranks_ptr + slots) + BLOCK_N - 1) // BLOCK_N * num_slices
    seg_items = seg_blocks * (ends - starts)
    items_incl = tl.cumsum(seg_items, axis=0)
    num_items = tl.sum(seg_items, axis=0)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        start, _, slot, local = _locate_item(item, starts, ends, slots, seg_items, items_incl)
        rank = _slot_value(slot, slot_ids, slot_ranks)
        live = (rank + BLOCK_N - 1) // BLOCK_N  # column blocks per slice below the rank
        row = start + local // (live * num_slices)
        block = local % (live * num_slices)
        cb = block // live * per_slice + block % live
        # one token, no split (h stands in for the unused partials and counters)
        _shrink_tile(x_ptr, a_ptr, h_ptr, h_ptr, h_ptr, row, row + 1, slot.to(tl.int64), rank,
                     0, cb, 0, num_tokens, K, stride_xt, stride_as, stride_ar, stride_ht,
                     MAX_RANK, NUM_COLS, NUM_CB, 1, BLOCK_N, BLOCK_K, K_PER_SPLIT, 1, EVEN_K,
                     PRECISION, PDL, PRELOAD_A, WEIGHT_EVICT)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, NUM_COLS, K]
    h_ptr,  # [T, NUM_COLS]
    part_ptr,  # [SPLIT_K, T, NUM_COLS] float32 (split-K partials)
    lock_ptr,  # [>= bound_tiles * NUM_CB] int32, zero between launches
    seg_indptr_ptr,
    seg_slots_ptr,
    slot_ranks_ptr,
    num_segments,
    num_slots,
    num_tokens,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    MAX_RANK: tl.constexpr,
    NUM_COLS: tl.constexpr,
    NUM_CB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD_A: tl.constexpr,  # PDL and one hidden step per item: A is read before the wait
    LIVE_ITEMS: tl.constexpr,  # one-token tiles: items only below each slot's rank
    WEIGHT_EVICT: tl.constexpr,  # A's loads: "evict_first" streams it past the caches
):
    if PDL:  # the next kernel may start its own prologue now
        gdc_launch_dependents()
    starts, ends, slots, tiles, tiles_incl = _segment_table(
        seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_S, BLOCK_M
    )
    slot_ids = tl.arange(0, BLOCK_SLOTS)
    slot_ranks = tl.load(slot_ranks_ptr + slot_ids, mask=slot_ids < num_slots, other=0)
    # Under PDL the previous kernel may still be running: x, h, the partials and the counters
    # are its to write or read until `gdc_wait`, which every item path calls before touching
    # them (after reading its A block, where the item is one hidden step).
    if LIVE_ITEMS:
        _shrink_live_items(x_ptr, a_ptr, h_ptr, slot_ranks_ptr, starts, ends, slots, slot_ids,
                           slot_ranks, num_tokens, K, stride_xt, stride_as, stride_ar,
                           stride_ht, MAX_RANK, NUM_COLS, NUM_CB, BLOCK_N, BLOCK_K, K_PER_SPLIT,
                           EVEN_K, PRECISION, PDL, PRELOAD_A, WEIGHT_EVICT)
    else:
        num_items = tl.sum(tiles, axis=0) * (NUM_CB * SPLIT_K)
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            ks = item % SPLIT_K
            cb = (item // SPLIT_K) % NUM_CB
            j = item // (SPLIT_K * NUM_CB)
            first_row, end_row, slot = _locate_tile(j, starts, ends, slots, tiles, tiles_incl,
                                                    BLOCK_M)
            rank = _slot_value(slot, slot_ids, slot_ranks)
            _shrink_tile(x_ptr, a_ptr, h_ptr, part_ptr, lock_ptr, first_row, end_row,
                         slot.to(tl.int64), rank, j, cb, ks, num_tokens, K, stride_xt,
                         stride_as, stride_ar, stride_ht, MAX_RANK, NUM_COLS, NUM_CB, BLOCK_M,
                         BLOCK_N, BLOCK_K, K_PER_SPLIT, SPLIT_K, EVEN_K, PRECISION, PDL,
                         PRELOAD_A, WEIGHT_EVICT)
    if PDL:  # a program without items still waits: no kernel ends before the one it follows
        gdc_wait()


@triton.jit
def _b_rows(b_slot, r, rank, cols, col_mask, stride_br, WEIGHT_EVICT: tl.constexpr):
    """Rows `r` of a slot's rank-major B over `cols`, [len(r), len(cols)]; rows at or past the
    slot's rank read nothing (zeros)."""
    return tl.load(b_slot + r[:, None] * stride_br + cols[None, :],
                   mask=(r < rank)[:, None] & col_mask[None, :], other=0.0,
                   eviction_policy=WEIGHT_EVICT)


@triton.jit
def _expand_tile(first_row, end_row, cols, col_mask, rank, scale, h_ptrs, b_slot, y_ptr,
                 stride_ht, stride_br, stride_yt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, MULTI_R: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr, WEIGHT_EVICT: tl.constexpr):
    """y[tile rows, cols] += scale * h[rows, slice ranks] . B[:rank, cols] in tile products.
    `h_ptrs` points at the slice's first rank column of h, `b_slot` at the slot's B ([R, out],
    rank-major). The first rank step's B rows are read before the wait; the steps after it, up
    to the slot's rank, one at a time."""
    offs_r = tl.arange(0, BLOCK_R)
    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < end_row
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    y_mask = row_mask[:, None] & col_mask[None, :]
    bv = _b_rows(b_slot, offs_r, rank, cols, col_mask, stride_br, WEIGHT_EVICT)  # [R step, N]
    if PDL:
        gdc_wait()
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
    hv = tl.load(h_ptrs + rows[:, None] * stride_ht + offs_r[None, :],
                 mask=row_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
    acc = _product_kn(hv.to(bv.dtype), bv, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                      PRECISION)
    if MULTI_R:  # the pool's max rank spans several steps (compiled only then: registers)
        for r0 in range(BLOCK_R, rank, BLOCK_R):
            r = r0 + offs_r
            bv = _b_rows(b_slot, r, rank, cols, col_mask, stride_br, WEIGHT_EVICT)
            hv = tl.load(h_ptrs + rows[:, None] * stride_ht + r[None, :],
                         mask=row_mask[:, None] & (r < rank)[None, :], other=0.0)
            acc = _product_kn(hv.to(bv.dtype), bv, acc, PRECISION)
    out = yv.to(tl.float32) + scale * acc
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _expand_token(row, cols, col_mask, rank, scale, h_ptrs, b_slot, y_ptr, stride_ht,
                  stride_br, stride_yt, BLOCK_R: tl.constexpr, MULTI_R: tl.constexpr,
                  PDL: tl.constexpr, WEIGHT_EVICT: tl.constexpr):
    """`_expand_tile` for a tile of one token (decode): y[row, cols] += scale * h[row, :rank] .
    B[:rank, cols], a matrix-vector product summed over each rank step's rows. A 16-row tile
    would carry 15 dead rows and hold 16 times the registers."""
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + row * stride_yt + cols
    bv = _b_rows(b_slot, offs_r, rank, cols, col_mask, stride_br, WEIGHT_EVICT)  # [R step, N]
    if PDL:
        gdc_wait()
    yv = tl.load(y_ptrs, mask=col_mask, other=0.0)
    hv = tl.load(h_ptrs + row * stride_ht + offs_r, mask=offs_r < rank, other=0.0)
    acc = tl.sum(bv.to(tl.float32) * hv.to(tl.float32)[:, None], axis=0)
    if MULTI_R:
        for r0 in range(BLOCK_R, rank, BLOCK_R):
            r = r0 + offs_r
            bv = _b_rows(b_slot, r, rank, cols, col_mask, stride_br, WEIGHT_EVICT)
            hv = tl.load(h_ptrs + row * stride_ht + r, mask=r < rank, other=0.0)
            acc += tl.sum(bv.to(tl.float32) * hv.to(tl.float32)[:, None], axis=0)
    out = yv.to(tl.float32) + scale * acc
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _sgmv_expand_kernel(
    h_ptr,  # [T, NUM_SLICES * MAX_RANK]
    b_ptr,  # [num_slots, MAX_RANK, O_4] (rank-major)
    y_ptr,  # [T, O_4]
    seg_indptr_ptr,
    seg_slots_ptr,
    slot_ranks_ptr,
    slot_scalings_ptr,
    num_segments,
    num_slots,
    stride_ht,
    stride_bs,
    stride_br,
    stride_yt,
    MAX_RANK: tl.constexpr,
    O_1: tl.constexpr,  # slice i owns output columns [O_i, O_{i+1}); O_0 = 0
    O_2: tl.constexpr,  # slices past NUM_SLICES have O_i = the total width (empty)
    O_3: tl.constexpr,
    O_4: tl.constexpr,
    NB_1: tl.constexpr,  # slice i owns column blocks [NB_i, NB_{i+1}); NB_0 = 0
    NB_2: tl.constexpr,
    NB_3: tl.constexpr,
    NUM_NB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MULTI_R: tl.constexpr,  # the max rank spans several rank steps
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    WEIGHT_EVICT: tl.constexpr,  # B's loads: "evict_first" streams it past the caches
):
    if PDL:  # the next kernel may start its own prologue now
        gdc_launch_dependents()
    starts, ends, slots, tiles, tiles_incl = _segment_table(
        seg_indptr_ptr, seg_slots_ptr, num_segments, BLOCK_S, BLOCK_M
    )
    slot_ids = tl.arange(0, BLOCK_SLOTS)
    slot_live = slot_ids < num_slots
    slot_ranks = tl.load(slot_ranks_ptr + slot_ids, mask=slot_live, other=0)
    slot_scales = tl.load(slot_scalings_ptr + slot_ids, mask=slot_live, other=0.0)
    # Under PDL, h and y are the previous kernels' until `gdc_wait`: an item reads its first
    # block of B before waiting, so the weight read overlaps the kernel before.
    num_items = tl.sum(tiles, axis=0) * NUM_NB
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        nb = item % NUM_NB
        j = item // NUM_NB
        first_row, end_row, slot = _locate_tile(j, starts, ends, slots, tiles, tiles_incl, BLOCK_M)
        rank = _slot_value(slot, slot_ids, slot_ranks)
        if rank > 0:
            scale = _slot_value(slot, slot_ids, slot_scales)
            sl, col0, col_end = _slice_columns(nb, O_1, O_2, O_3, O_4, NB_1, NB_2, NB_3, BLOCK_N)
            b_slot = b_ptr + slot.to(tl.int64) * stride_bs
            h_ptrs = h_ptr + (sl * MAX_RANK).to(tl.int64)
            cols = col0 + tl.arange(0, BLOCK_N)
            if BLOCK_M > 1 and end_row - first_row > 1:  # several tokens: tile products
                _expand_tile(first_row, end_row, cols, cols < col_end, rank, scale, h_ptrs,
                             b_slot, y_ptr, stride_ht, stride_br, stride_yt, BLOCK_M, BLOCK_N,
                             BLOCK_R, MULTI_R, PRECISION, PDL, WEIGHT_EVICT)
            else:
                _expand_token(first_row.to(tl.int64), cols, cols < col_end, rank, scale, h_ptrs,
                              b_slot, y_ptr, stride_ht, stride_br, stride_yt, BLOCK_R, MULTI_R,
                              PDL, WEIGHT_EVICT)
    if PDL:  # a program without items still waits: no kernel ends before the one it follows
        gdc_wait()


@dataclass(frozen=True)
class Plan:
    """A launch's grid and compile-time constants, which depend on shapes alone."""

    grid: tuple[int]
    constants: dict  # keyword arguments of the kernel: block sizes, counts, warps, stages
    split_k: int = 1
    num_locks: int = 0


# Plans are pure functions of the frozen tuning and a few integers, memoized by value.
@functools.lru_cache(maxsize=4096)
def shrink_plan(tuning: SgmvTuning, one_token_segments: bool, num_tokens: int, hidden: int,
                num_cols: int, max_rank: int, num_segments: int, num_slots: int, float32: bool,
                num_sms: int, pdl: bool) -> Plan:
    t = tuning.shrink_tiling(num_tokens, one_token_segments, max_rank, float32)
    block_k = min(t.block_k, _pow2_at_least_16(hidden))
    k_per_split = cdiv(min(t.k_per_split, hidden), block_k) * block_k
    split_k = cdiv(hidden, k_per_split)
    block_n = min(t.block_n, _pow2_at_least_16(num_cols))
    if t.max_a_block is not None:  # wide hidden sizes: fewer whole rows of A per item
        block_n = min(block_n, _pow2_at_most(max(1, t.max_a_block // k_per_split)))
    num_cb = cdiv(num_cols, block_n)
    bound_tiles = _bound_tiles(num_tokens, t.block_m, num_segments)
    constants = dict(
        _shared_constants(t, max_rank, num_segments, num_slots, pdl),
        NUM_COLS=num_cols,
        NUM_CB=num_cb,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_PER_SPLIT=k_per_split,
        SPLIT_K=split_k,
        EVEN_K=hidden % block_k == 0,
        PRELOAD_A=pdl and k_per_split == block_k,
        LIVE_ITEMS=t.live_items and split_k == 1 and max_rank % block_n == 0,
    )
    grid = (min(bound_tiles * num_cb * split_k, num_sms * t.programs_per_sm),)
    return Plan(grid, constants, split_k, bound_tiles * num_cb if split_k > 1 else 0)


@functools.lru_cache(maxsize=4096)
def expand_plan(tuning: SgmvTuning, one_token_segments: bool, num_tokens: int,
                out_offsets: tuple[int, ...], max_rank: int, num_segments: int, num_slots: int,
                float32: bool, num_sms: int, pdl: bool) -> Plan:
    t = tuning.expand_tiling(num_tokens, one_token_segments, max_rank, float32)
    block_r = min(t.block_r, max(16, next_pow2(max_rank)))
    block_n, num_nb, slice_consts = _slice_blocks(out_offsets, t.block_n)
    bound_tiles = _bound_tiles(num_tokens, t.block_m, num_segments)
    constants = dict(
        _shared_constants(t, max_rank, num_segments, num_slots, pdl),
        **slice_consts,
        NUM_NB=num_nb,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        MULTI_R=max_rank > block_r,
    )
    return Plan((min(bound_tiles * num_nb, num_sms * t.programs_per_sm),), constants)


def _bound_tiles(num_tokens: int, block_m: int, num_segments: int) -> int:
    """The most token tiles `num_segments` disjoint segments over `num_tokens` tokens can own: a
    non-empty segment of l tokens owns ceil(l / block_m) = (l + block_m - 1) // block_m, and at
    most min(S, T) segments are non-empty (so the bound never passes T: no tile is empty)."""
    live = min(num_segments, num_tokens)
    return (num_tokens + live * (block_m - 1)) // block_m


def _shared_constants(t, max_rank: int, num_segments: int, num_slots: int, pdl: bool) -> dict:
    """What both kernels' launches take alike: the segment and slot tables' widths, the token
    tile, warps and stages, the weight loads' cache policy and programmatic dependent launch
    (the `PDL` constant and Triton's `launch_pdl` option travel together)."""
    return dict(
        MAX_RANK=max_rank,
        BLOCK_S=_pow2_at_least_16(num_segments),
        BLOCK_SLOTS=_slot_block(num_slots),
        BLOCK_M=t.block_m,
        WEIGHT_EVICT="evict_first" if t.stream_weights else "",
        PDL=pdl,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )


def _slice_blocks(out_offsets: tuple[int, ...], block_cap: int) -> tuple[int, int, dict]:
    """Output column blocks over a group's fused slices, as `_slice_columns` reads them: the
    block width (at most `block_cap`), the number of blocks and the expand kernel's O_i / NB_i
    constants (slices past the group's count are empty)."""
    widths = [hi - lo for lo, hi in zip(out_offsets, out_offsets[1:], strict=False)]
    block = min(block_cap, _pow2_at_least_16(max(widths)))
    offsets = list(out_offsets[1:]) + [out_offsets[-1]] * (MAX_SLICES - len(widths))
    first_blocks = [0]
    for w in widths:
        first_blocks.append(first_blocks[-1] + cdiv(w, block))
    num_nb = first_blocks[-1]
    first_blocks += [num_nb] * (MAX_SLICES + 1 - len(first_blocks))
    consts = {f"O_{i + 1}": offsets[i] for i in range(MAX_SLICES)}
    consts.update({f"NB_{i}": first_blocks[i] for i in range(1, MAX_SLICES)})
    return block, num_nb, consts


def _slot_block(num_slots: int) -> int:
    """The slot table's width in registers, at least 64: pools of up to 64 slots share compiled
    kernels (else another `max_loras_per_batch` compiles them all again: minutes, measured in
    docs/perf/sgmv_tuning.md)."""
    return max(64, next_pow2(num_slots))


def _pow2_at_least_16(n: int) -> int:
    return max(16, next_pow2(n))


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _unrolled(t: torch.Tensor) -> bool:
    """Compiled float32 (tiles capped); the interpreter keeps every tiling CPU tests ask for."""
    return t.dtype == torch.float32 and t.is_cuda


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 must not round through tf32


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or later, and a Triton with `launch_pdl`."""
    if not _HAVE_GDC or device.type != "cuda" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:  # griddepcontrol: Hopper and later
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_lock_buffers: dict[torch.device, list[torch.Tensor]] = {}


def _locks(device: torch.device, needed: int) -> torch.Tensor:
    """Split-K arrival counters, zero between launches. Buffers are never freed: a captured CUDA
    graph keeps the address it was captured with. Grow one before capture (warm-up) if needed."""
    buffers = _lock_buffers.setdefault(device, [])
    if not buffers or buffers[-1].numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "SGMV split-K counters must grow during CUDA-graph capture; run the largest "
                "shape once before capturing"
            )
        buffers.append(torch.zeros(max(needed, _LOCK_MIN), dtype=torch.int32, device=device))
    return buffers[-1]


# Eager steps launch each kernel once per layer with the same plan: skip Triton's dispatch.
_SHRINK = CachedLaunch(_sgmv_shrink_kernel)
_EXPAND = CachedLaunch(_sgmv_expand_kernel)


class TritonSgmv(SgmvBackend):
    """The Triton kernels under one frozen tuning (rows, PDL, cached launches)."""

    def __init__(self, tuning: SgmvTuning = DEFAULT_TUNING) -> None:
        self.tuning = tuning

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: SgmvBatch,
               num_slices: int) -> torch.Tensor:
        """x: [T, in]; a: [num_slots, n*R, in] -> h: [T, n*R] in x's dtype (base-model rows
        unspecified; the columns at or past a token's slot rank zeros, or unspecified under a
        `live_items` row: the expand reads none of them)."""
        num_tokens, hidden = x.shape
        num_cols = a.shape[1]
        assert a.dim() == 3 and a.shape[2] == hidden, f"a {tuple(a.shape)} vs x {tuple(x.shape)}"
        assert num_slices >= 1 and num_cols % num_slices == 0
        max_rank = num_cols // num_slices
        assert x.dtype == a.dtype and x.dtype in DTYPES, f"{x.dtype} / {a.dtype}"
        assert x.stride(1) == 1 and a.stride(2) == 1, "the hidden dimension must be contiguous"
        _check_batch(batch, num_tokens, x.device)
        h = x.new_empty(num_tokens, num_cols)
        num_segments = batch.num_segments
        if num_segments == 0:
            return h
        device, num_slots = x.device, batch.slot_ranks.shape[0]
        plan = shrink_plan(self.tuning, batch.one_token_segments, num_tokens, hidden, num_cols,
                           max_rank, num_segments, num_slots, _unrolled(x), _num_sms(device),
                           self._pdl(device))
        if plan.split_k > 1:
            part = torch.empty(plan.split_k, num_tokens, num_cols, dtype=torch.float32,
                               device=device)
            locks = _locks(device, plan.num_locks)
        else:
            part, locks = h, batch.seg_slots  # unused by the kernel
        _SHRINK(plan, (x, a, h, part, locks, batch.seg_indptr, batch.seg_slots, batch.slot_ranks,
                       num_segments, num_slots, num_tokens, hidden,
                       x.stride(0), a.stride(0), a.stride(1), h.stride(0)),
                self.tuning.cached_launches, PRECISION=_precision(x.dtype))
        return h

    def expand(self, h: torch.Tensor, b: torch.Tensor, batch: SgmvBatch, y: torch.Tensor,
               out_offsets: tuple[int, ...]) -> None:
        """h: [T, n*R] in y's dtype; b: [num_slots, R, sum(out_i)]; y: [T, sum(out_i)] updated
        in place."""
        num_slices = len(out_offsets) - 1
        num_tokens, width = y.shape
        max_rank = b.shape[1]
        assert 1 <= num_slices <= MAX_SLICES, f"{num_slices} slices (at most {MAX_SLICES})"
        assert out_offsets[0] == 0 and out_offsets[-1] == width == b.shape[2]
        assert all(lo < hi for lo, hi in zip(out_offsets, out_offsets[1:], strict=False))
        assert h.shape == (num_tokens, num_slices * max_rank), f"h {tuple(h.shape)}"
        assert h.dtype == b.dtype == y.dtype and y.dtype in DTYPES, f"{h.dtype}/{b.dtype}/{y.dtype}"
        assert h.stride(1) == 1 and b.stride(2) == 1 and y.stride(1) == 1, "last dims contiguous"
        _check_batch(batch, num_tokens, y.device)
        num_segments = batch.num_segments
        if num_segments == 0:
            return
        device, num_slots = y.device, batch.slot_ranks.shape[0]
        plan = expand_plan(self.tuning, batch.one_token_segments, num_tokens, tuple(out_offsets),
                           max_rank, num_segments, num_slots, _unrolled(y), _num_sms(device),
                           self._pdl(device))
        _EXPAND(plan, (h, b, y, batch.seg_indptr, batch.seg_slots, batch.slot_ranks,
                       batch.slot_scalings, num_segments, num_slots,
                       h.stride(0), b.stride(0), b.stride(1), y.stride(0)),
                self.tuning.cached_launches, PRECISION=_precision(y.dtype))

    def graph_variants(self, num_tokens: int, max_rank: int) -> tuple[bool, ...]:
        """Both `one_token_segments` values where the tuning picks other tilings for batches
        whose every segment is one token, else one graph (True) for all."""
        if self.tuning.one_token_variant_differs(num_tokens, max_rank):
            return (True, False)
        return (True,)

    def _pdl(self, device: torch.device) -> bool:
        return self.tuning.pdl and pdl_supported(device)


def _check_batch(batch: SgmvBatch, num_tokens: int, device: torch.device) -> None:
    """What a launch adds to SgmvBatch's own checks: the batch fits x and lives beside it."""
    assert batch.num_tokens <= num_tokens, f"batch has {batch.num_tokens} tokens, x {num_tokens}"
    assert batch.seg_indptr.device == device, "metadata must be on the kernel's device"
