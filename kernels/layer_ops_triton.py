"""The per-layer elementwise operations in Triton, one launch each (contract and torch reference:
kernels/layer_ops.py).

Every kernel computes in float32 and rounds to the activation dtype exactly where the torch
reference (and transformers) rounds, so a bfloat16 model gives the same values up to the order
of one float32 sum. Grids depend only on shapes and no launcher reads a device value, so each
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import CachedLaunch, cdiv, next_pow2
from kernels.layer_ops import LayerOps

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SILU_BLOCK = 1024  # output columns per program of silu_and_mul


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (float32) rounded to the activation dtype and back, as a torch op's output would be."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, D]
    delta_ptr,  # [N, D] (HAS_DELTA)
    w_ptr,  # [D]
    out_ptr,  # [N, D]
    sum_ptr,  # [N, D] x + delta (HAS_DELTA)
    D,
    stride_x,
    stride_delta,
    stride_out,
    stride_sum,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = _round(x + delta.to(tl.float32), dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x.to(dtype), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    h = _round(x * inv, dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * h).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr,  # [N, 2I]
    out_ptr,  # [N, I]
    inter,
    stride_gu,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, HQ, D], rotated in place
    k_ptr,  # [T, HK, D], rotated in place
    pos_ptr,  # [T]
    cos_ptr,  # [P, D/2] float32
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    HQ: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < HQ:
        base = q_ptr + t * stride_qt + head * stride_qh
    else:
        base = k_ptr + t * stride_kt + (head - HQ) * stride_kh
    dtype = q_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = _round(tl.load(cos_ptr + pos * stride_cs + offs, mask=mask, other=0.0), dtype)
    s = _round(tl.load(sin_ptr + pos * stride_cs + offs, mask=mask, other=0.0), dtype)
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    out1 = _round(x1 * c, dtype) - _round(x2 * s, dtype)
    out2 = _round(x2 * c, dtype) + _round(x1 * s, dtype)
    tl.store(base + offs, out1.to(dtype), mask=mask)
    tl.store(base + HALF + offs, out2.to(dtype), mask=mask)


# Eager steps launch each of these once per layer: skip Triton's dispatch (kernels/launch.py).
_RMS_NORM = CachedLaunch(_rms_norm_kernel)
_SILU_AND_MUL = CachedLaunch(_silu_and_mul_kernel)
_ROTARY = CachedLaunch(_rotary_kernel)


def _rows(x: torch.Tensor, name: str) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"{name} must be [N, D] with contiguous rows"
    assert x.dtype in DTYPES, f"{name}: {x.dtype}"


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _rows(x, "x")
    n, d = x.shape
    assert weight.shape == (d,) and weight.is_contiguous()
    out = torch.empty_like(x)
    if n:
        _RMS_NORM.run(
            (n,), (x, x, weight, out, out, d, x.stride(0), 0, out.stride(0), 0, eps),
            HAS_DELTA=False, BLOCK_D=next_pow2(d),
        )
    return out


def triton_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _rows(x, "x")
    _rows(delta, "delta")
    n, d = x.shape
    assert delta.shape == x.shape and delta.dtype == x.dtype
    assert weight.shape == (d,) and weight.is_contiguous()
    out, total = torch.empty_like(x), torch.empty_like(x)
    if n:
        _RMS_NORM.run(
            (n,),
            (x, delta, weight, out, total, d,
             x.stride(0), delta.stride(0), out.stride(0), total.stride(0), eps),
            HAS_DELTA=True, BLOCK_D=next_pow2(d),
        )
    return out, total


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _rows(gate_up, "gate_up")
    n, width = gate_up.shape
    assert width % 2 == 0, f"gate_up width {width} is odd"
    inter = width // 2
    out = gate_up.new_empty(n, inter)
    block = min(SILU_BLOCK, next_pow2(inter))
    if n:
        _SILU_AND_MUL.run(
            (n, cdiv(inter, block)), (gate_up, out, inter, gate_up.stride(0), out.stride(0)),
            BLOCK=block,
        )
    return out


def triton_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they may be views into one fused qkv buffer)."""
    assert q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.dtype == k.dtype and q.dtype in DTYPES
    assert cos.shape == sin.shape and cos.shape[1] == head_dim // 2 and cos.stride(1) == 1
    assert cos.stride(0) == sin.stride(0) and cos.dtype == sin.dtype == torch.float32
    assert positions.is_contiguous() and not positions.is_floating_point()
    if num_tokens:
        _ROTARY.run(
            (num_tokens, num_q_heads + k.shape[1]),
            (q, k, positions, cos, sin,
             q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0)),
            HQ=num_q_heads, HALF=head_dim // 2, BLOCK=next_pow2(head_dim // 2),
        )
    return q, k


TRITON_LAYER_OPS = LayerOps(triton_rms_norm, triton_add_rms_norm, triton_silu_and_mul,
                            triton_rotary)
