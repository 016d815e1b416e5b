"""Paged attention in Triton: a decode kernel and a prefill kernel over the paged KV cache.

Both read keys and values through the block table (the new tokens' K/V are already stored) and
group the query heads that share a KV head into one program, so each KV head's cache is read once
per sequence (GQA). Softmax is online, in float32, in base 2.

Decode (one new token per sequence) is flash-decoding over a work list: grid
(B + max_extra, Hkv). Every program reads all context lengths and computes the same plan: the
batch's keys are cut into about `batch_pieces` pieces per KV head (enough to fill the GPU), none
shorter than `min_split_tokens`, and each sequence takes as many pieces as it holds. Program i < B
reads split 0 of sequence i; program B + e reads the e-th further split in sequence order. A
sequence far longer than the others is spread over several programs instead of finishing alone,
while a batch of even lengths runs one program per (sequence, KV head) with the spare programs
exiting at once. A sequence read by one program gets its output written directly; one read by
several gets float32 partials that a second kernel merges in split order (deterministic, no
atomics). The grid depends only on static shapes (max_extra from Hkv, the SM count and
block_table.shape[1]), the plan only on device values, and a row of context length 0 (padding)
exits before any read, so the decode path can be captured in a CUDA graph and replayed over new
metadata.

Prefill (chunks of new tokens at the end of each context) tiles BLOCK_Q tokens x the query heads
of one KV head into one program; grid (T // BLOCK_Q + B, Hkv). Sequence i owns the tiles that
start at q_starts[i] // BLOCK_Q + i, found by binary search over q_starts, so the grid depends on
T and B only; the spare tiles exit at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TypedDict

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionBatch
from kernels.launch import CachedLaunch, cdiv, next_pow2

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # a window wider than any context: nothing is masked


@dataclass(frozen=True)
class DecodeTiling:
    block_n: int = 64  # keys per loop step
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4  # the batch's keys are cut into about this many pieces per SM
    min_split_tokens: int = 256  # a shorter split costs more to merge than it saves


@dataclass(frozen=True)
class PrefillTiling:
    block_m: int = 64  # query rows per program: BLOCK_Q tokens x the padded group of heads
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


DECODE_TILING = DecodeTiling()
PREFILL_TILING = PrefillTiling()


@triton.jit
def _window_start(q_pos, window):
    """First key position a query at `q_pos` sees: keys at q_pos - window or earlier are masked."""
    return tl.maximum(q_pos - window + 1, 0)


@triton.jit
def _decode_plan(
    ctx_lens_ptr, num_seqs, window, batch_pieces,
    SEQS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    """The split plan of the batch, per sequence [SEQS_PAD]: (context length, keys per split,
    splits, end of its further splits in the work list after the B first ones).

    The visible keys of the batch are cut into pieces of `total / batch_pieces` keys, at least
    MIN_SPLIT; a sequence takes its keys / piece splits, rounded to the nearest (at least 1), cut
    evenly in whole tiles. Its splits past the first number fewer than its keys / piece (rounding
    up needs 1.5 pieces), so all further splits number fewer than batch_pieces."""
    offs = tl.arange(0, SEQS_PAD)
    ctx = tl.load(ctx_lens_ptr + offs, mask=offs < num_seqs, other=0)
    keys = tl.minimum(ctx, window)
    piece = tl.maximum(tl.cdiv(tl.sum(keys, axis=0), batch_pieces), MIN_SPLIT)
    wanted = tl.maximum((keys + piece // 2) // piece, 1)
    split_len = tl.cdiv(tl.cdiv(keys, wanted), BLOCK_N) * BLOCK_N
    splits = tl.cdiv(keys, tl.maximum(split_len, 1))  # 0 for padding rows
    extra_end = tl.cumsum(tl.maximum(splits - 1, 0), axis=0)
    return ctx, split_len, splits, extra_end


@triton.jit
def _pick(values, offs, index):
    """values[index] of a [SEQS_PAD] vector, as a scalar."""
    return tl.sum(tl.where(offs == index, values, 0), axis=0)


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_row_ptr, pos, valid, kv_head, offs_d,
    stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr,
):
    """Gather the cache rows of token positions `pos` [N] of one KV head -> [N, D]."""
    page = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = page * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _online_softmax_step(q, k, v, mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile of keys into the running (max, sum, acc) of each query row.

    q: [M, D]; k, v: [N, D]; mask: [M, N] (True = attend). m_i starts finite, so a row whose keys
    are all masked so far keeps p = 0 and alpha = 1 instead of producing NaN."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 domain
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, ctx_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, window, num_q_heads, num_seqs, batch_pieces,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SEQS_PAD: tl.constexpr,
    MIN_SPLIT: tl.constexpr, HAS_EXTRA: tl.constexpr, PRECISION: tl.constexpr,
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_b = tl.arange(0, SEQS_PAD)
    ctx_all, len_all, splits_all, end_all = _decode_plan(
        ctx_lens_ptr, num_seqs, window, batch_pieces, SEQS_PAD, BLOCK_N, MIN_SPLIT
    )
    # Work item -> (sequence, split): the B first are split 0 of each sequence; the others are
    # the further splits of all sequences in order (padding lanes sort last).
    extra = work - num_seqs
    seq_of_extra = tl.sum((end_all <= extra).to(tl.int32), axis=0)
    seq = tl.where(work < num_seqs, work, seq_of_extra)
    splits = _pick(splits_all, offs_b, seq)
    split = tl.where(work < num_seqs, 0, extra - (_pick(end_all, offs_b, seq) - splits))
    if split >= splits:  # padding row, or a spare work item
        return
    ctx = _pick(ctx_all, offs_b, seq)
    split_len = _pick(len_all, offs_b, seq)
    lo = ctx - tl.minimum(ctx, window) + split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_ok[:, None], other=0.0,
    )  # [GROUP_PAD, D]
    table_row = block_table_ptr + seq * stride_bt
    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k = _load_kv_tile(k_cache_ptr, table_row, pos, valid, kv_head, offs_d,
                          stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, table_row, pos, valid, kv_head, offs_d,
                          stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, PRECISION
        )

    # A sequence's only split writes its output; each of several writes partials to the row of
    # its work item, [B + max_extra, Hq(, D)] float32 (m and l interleaved), unnormalized.
    direct = offs_g < tl.where(splits == 1, GROUP, 0)
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=direct[:, None],
    )
    if HAS_EXTRA:
        row = work * num_q_heads + heads
        to_merge = offs_g < tl.where(splits > 1, GROUP, 0)
        tl.store(part_ml_ptr + 2 * row, m_i, mask=to_merge)
        tl.store(part_ml_ptr + 2 * row + 1, l_i, mask=to_merge)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=to_merge[:, None])


@triton.jit
def _decode_merge_kernel(
    ctx_lens_ptr, part_acc_ptr, part_ml_ptr, out_ptr,
    window, num_q_heads, num_seqs, batch_pieces, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, SEQS_PAD: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    """Merge the splits of one (sequence, KV head)'s query heads, in split order."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_b = tl.arange(0, SEQS_PAD)
    _, _, splits_all, end_all = _decode_plan(
        ctx_lens_ptr, num_seqs, window, batch_pieces, SEQS_PAD, BLOCK_N, MIN_SPLIT
    )
    splits = _pick(splits_all, offs_b, seq)
    if splits <= 1:  # padding row, or written directly by its only split
        return
    first_extra = num_seqs + _pick(end_all, offs_b, seq) - (splits - 1)  # work row of split 1
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in range(0, splits):
        work = tl.where(split == 0, seq, first_extra + split - 1)
        row = work * num_q_heads + heads
        m_s = tl.load(part_ml_ptr + 2 * row, mask=head_ok, other=0.0)
        l_s = tl.load(part_ml_ptr + 2 * row + 1, mask=head_ok, other=0.0)
        acc_s = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=head_ok[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(m_s - m_new)
        l_sum = l_sum * alpha + l_s * w
        acc = acc * alpha[:, None] + acc_s * w[:, None]
        m = m_new
    o = acc / tl.where(head_ok, l_sum, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, ctx_lens_ptr, q_starts_ptr, out_ptr,
    qk_scale, window, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence whose tiles start at or before `tile`: the largest i with
    # q_starts[i] // BLOCK_Q + i <= tile (that key is nondecreasing in i).
    lo = tl.full([], 0, tl.int32)
    hi = lo + (num_seqs - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(q_starts_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(q_starts_ptr + seq)
    num_new = tl.load(q_starts_ptr + seq + 1) - q_start
    first_tok = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # first new token of this tile
    if first_tok >= num_new:  # a spare tile
        return
    ctx = tl.load(ctx_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tok = first_tok + offs_m // GROUP_PAD  # row = (token, head in group), head fastest
    g = offs_m % GROUP_PAD
    row_ok = (tok < num_new) & (g < GROUP)
    heads = kv_head * GROUP + g
    q_pos = ctx - num_new + tok  # [M]
    q_offs = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    table_row = block_table_ptr + seq * stride_bt
    key_lo = _window_start(ctx - num_new + first_tok, window)
    key_hi = tl.minimum(ctx - num_new + first_tok + BLOCK_Q, ctx)  # past the tile's last query

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(key_lo, key_hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < key_hi
        k = _load_kv_tile(k_cache_ptr, table_row, pos, valid, kv_head, offs_d,
                          stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, table_row, pos, valid, kv_head, offs_d,
                          stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        dist = q_pos[:, None] - pos[None, :]  # [M, N]: causal and sliding window
        mask = valid[None, :] & (dist >= 0) & (dist < window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, mask, m_i, l_i, acc, qk_scale, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on padded rows
    o_offs = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode_batch_pieces(
    num_kv_heads: int, device: torch.device, tiling: DecodeTiling = DECODE_TILING
) -> int:
    """Pieces to cut the batch's keys into, per KV head: programs_per_sm on every SM."""
    sms = _num_sms(device.index) if device.type == "cuda" else 1
    return cdiv(tiling.programs_per_sm * sms, num_kv_heads)


def decode_max_extra(
    batch_size: int, num_kv_heads: int, max_context: int, device: torch.device,
    tiling: DecodeTiling = DECODE_TILING,
) -> int:
    """Static bound on the work items past the B first (the further splits of all sequences):
    fewer than batch_pieces, and fewer than max_context / min_split_tokens per sequence."""
    per_seq = cdiv(max_context, tiling.min_split_tokens) - 1
    return min(decode_batch_pieces(num_kv_heads, device, tiling), batch_size * per_seq)


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [N, bs, Hkv, D]"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim contiguous"
    assert q.device == k_cache.device == v_cache.device
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert q.shape[2] == head_dim, (q.shape, k_cache.shape)
    assert q.shape[1] % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two >= 16"


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _group_pad(group: int, at_least: int) -> int:
    return max(at_least, next_pow2(group))


# Eager steps launch these once per layer: skip Triton's dispatch (kernels/launch.py).
_DECODE = CachedLaunch(_decode_kernel)
_DECODE_MERGE = CachedLaunch(_decode_merge_kernel)
_PREFILL = CachedLaunch(_prefill_kernel)


class _DecodePlan(TypedDict):
    """The split plan's constants, the same for the decode kernel and its merge."""

    SEQS_PAD: int
    BLOCK_N: int
    MIN_SPLIT: int


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    tiling: DecodeTiling = DECODE_TILING,
) -> torch.Tensor:
    """One new token per sequence. q: [B, Hq, D]; caches: [num_blocks, block_size, Hkv, D];
    block_table: [B, max_blocks] int32; ctx_lens: [B] int32, tokens in the cache including the new
    one (0 = padding row: its output rows are left unwritten). Returns out [B, Hq, D].

    Reads no device value on the host and sizes its grid from shapes alone (B, Hkv,
    block_table.shape[1] and the device's SM count), so it may run under CUDA-graph capture."""
    _check_cache(q, k_cache, v_cache)
    B, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert block_table.dtype == torch.int32 and block_table.dim() == 2, block_table.dtype
    assert block_table.shape[0] == B and block_table.stride(1) == 1, block_table.shape
    assert ctx_lens.dtype == torch.int32 and ctx_lens.shape == (B,), (ctx_lens.dtype, ctx_lens)
    assert ctx_lens.is_contiguous()
    assert sliding_window is None or sliding_window > 0, sliding_window
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    window = NO_WINDOW if sliding_window is None else sliding_window
    pieces = decode_batch_pieces(num_kv_heads, q.device, tiling)
    max_extra = decode_max_extra(B, num_kv_heads, block_table.shape[1] * block_size, q.device,
                                 tiling)
    plan = _DecodePlan(SEQS_PAD=next_pow2(B), BLOCK_N=tiling.block_n,
                       MIN_SPLIT=tiling.min_split_tokens)
    if max_extra:
        part_acc = q.new_empty(B + max_extra, num_q_heads, head_dim, dtype=torch.float32)
        part_ml = q.new_empty(B + max_extra, num_q_heads, 2, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    _DECODE.run(
        (B + max_extra, num_kv_heads),
        (q, k_cache, v_cache, block_table, ctx_lens,
         out, part_acc, part_ml,
         scale * LOG2E, window, num_q_heads, B, pieces,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         block_table.stride(0),
         out.stride(0), out.stride(1)),
        GROUP=group, GROUP_PAD=_group_pad(group, 16), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, HAS_EXTRA=max_extra > 0, PRECISION=_precision(q.dtype), **plan,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    if max_extra:
        _DECODE_MERGE.run(
            (B, num_kv_heads),
            (ctx_lens, part_acc, part_ml, out,
             window, num_q_heads, B, pieces, out.stride(0), out.stride(1)),
            GROUP=group, GROUP_PAD=_group_pad(group, 1), HEAD_DIM=head_dim, **plan,
            num_warps=2,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    *,
    tiling: PrefillTiling = PREFILL_TILING,
) -> torch.Tensor:
    """q: [T, Hq, D], flat over sequences (`batch.q_starts_t`); each sequence's new tokens are the
    last ones of its context and attend causally over the cached prefix and each other.
    Returns out [T, Hq, D]."""
    _check_cache(q, k_cache, v_cache)
    T, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    B = batch.num_seqs
    assert block_size == batch.block_size, (block_size, batch.block_size)
    table, ctx_lens, q_starts = batch.block_table, batch.ctx_lens_t, batch.q_starts_t
    assert table.dtype == torch.int32 and table.shape[0] == B and table.stride(1) == 1
    assert ctx_lens.dtype == torch.int32 and ctx_lens.shape == (B,) and ctx_lens.is_contiguous()
    assert q_starts.dtype == torch.int32 and q_starts.shape == (B + 1,) and q_starts.is_contiguous()
    assert batch.q_starts[-1] == T, (batch.q_starts[-1], T)
    group = num_q_heads // num_kv_heads
    group_pad = _group_pad(group, 1)
    block_q = max(1, tiling.block_m // group_pad)
    block_q = max(block_q, cdiv(16, group_pad))  # tl.dot needs >= 16 rows
    window = NO_WINDOW if batch.sliding_window is None else batch.sliding_window
    out = torch.empty_like(q)
    _PREFILL.run(
        (T // block_q + B, num_kv_heads),
        (q, k_cache, v_cache, table, ctx_lens, q_starts, out,
         scale * LOG2E, window, B,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         table.stride(0),
         out.stride(0), out.stride(1)),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad,
        BLOCK_N=tiling.block_n,
        PRECISION=_precision(q.dtype),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return out


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Same contract as `torch_paged_attention`. Every sequence feeds at least one token, so
    T == B means one token each: the decode kernel (graph-capturable); otherwise prefill."""
    if q.shape[0] == batch.num_seqs:
        assert k_cache.shape[1] == batch.block_size, (k_cache.shape, batch.block_size)
        return paged_decode_attention(
            q, k_cache, v_cache, batch.block_table, batch.ctx_lens_t, scale, batch.sliding_window
        )
    return paged_prefill_attention(q, k_cache, v_cache, batch, scale)
