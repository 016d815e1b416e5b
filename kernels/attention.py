"""Paged attention: the torch reference path (CPU, and the GPU fallback).

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step
feeds each sequence's new tokens (a prefill chunk or one decode token) as one flat batch; the new
keys and values are written at `slot_mapping` first, then every sequence attends over its whole
context (cached prefix + new tokens), causally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionBatch:
    """Per-step attention metadata, shared by every layer."""

    q_starts: list[int]  # host [B+1]: offsets of each sequence's new tokens in the flat batch
    ctx_lens: list[int]  # host [B]: tokens in the cache for each sequence after this step
    slot_mapping: torch.Tensor  # [T] int64, device: flat cache index of each new token
    block_table: torch.Tensor  # [B, max_blocks] int32, device (rows padded with zeros)
    ctx_lens_t: torch.Tensor  # [B] int32, device
    q_starts_t: torch.Tensor  # [B+1] int32, device
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        assert len(self.q_starts) == len(self.ctx_lens) + 1
        for i, ctx in enumerate(self.ctx_lens):
            assert ctx >= self.q_starts[i + 1] - self.q_starts[i] > 0

    @property
    def num_seqs(self) -> int:
        return len(self.ctx_lens)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D] written into the caches at flat indices `slot_mapping` [T]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def torch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Loops over sequences with host-known lengths (no sync)."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    bs = batch.block_size
    for i, ctx in enumerate(batch.ctx_lens):
        s, e = batch.q_starts[i], batch.q_starts[i + 1]
        n = e - s
        blocks = batch.block_table[i, : -(-ctx // bs)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        mask = _mask(n, ctx, batch.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def _mask(n: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [n, ctx] mask (True = attend) for queries at positions ctx-n .. ctx-1."""
    if n == 1 and (window is None or ctx <= window):
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


# (q, k_cache, v_cache, batch, scale) -> attention output, shaped like q
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, float], torch.Tensor
]


def get_attention_backend(name: str) -> AttentionFn:
    """"torch" (the reference, any device) or "triton" (GPU kernels; graph-capturable decode)."""
    if name == "torch":
        return torch_paged_attention
    if name == "triton":
        from kernels.attention_triton import triton_paged_attention

        return triton_paged_attention
    raise ValueError(f"unknown attention backend {name!r}; known: torch, triton")
