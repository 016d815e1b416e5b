"""The small per-layer operations of a decoder between its matrix products: RMSNorm (alone and
fused with the residual add), SiLU-and-multiply, and rotary embeddings of q and k.

Each is a handful of elementwise torch ops; run one by one they cost a kernel launch each (about
35 per layer), which dominates an eager step's host time and adds a few microseconds apiece under
CUDA graphs. `kernels/layer_ops_triton.py` does each in one launch. Both backends round where
transformers rounds (float32 math, results cast to the activation dtype at the same points), so
they agree with it and with each other.

Contract (`LayerOps`):
- rms_norm(x [N, D], weight [D], eps) -> [N, D]
- add_rms_norm(x [N, D], delta [N, D], weight [D], eps) -> (rms_norm(x + delta), x + delta)
- silu_and_mul(gate_up [N, 2I]) -> silu(gate) * up [N, I]
- rotary(q [T, Hq, D], k [T, Hk, D], positions [T], cos [P, D/2], sin [P, D/2]) -> (q, k)
  rotated (half-split layout). May write into q and k: use the returned tensors.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F


class RmsNormFn(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class AddRmsNormFn(Protocol):
    def __call__(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SiluAndMulFn(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RotaryFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerOps(NamedTuple):
    rms_norm: RmsNormFn
    add_rms_norm: AddRmsNormFn
    silu_and_mul: SiluAndMulFn
    rotary: RotaryFn


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def torch_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return torch_rms_norm(x, weight, eps), x


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def torch_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, c, s), _rotate(k, c, s)


TORCH_LAYER_OPS = LayerOps(torch_rms_norm, torch_add_rms_norm, torch_silu_and_mul, torch_rotary)


def get_layer_ops(name: str) -> LayerOps:
    """The ops named "torch" (the reference, any device) or "triton" (one launch each; needs
    triton)."""
    if name == "torch":
        return TORCH_LAYER_OPS
    if name == "triton":
        from kernels.layer_ops_triton import TRITON_LAYER_OPS

        return TRITON_LAYER_OPS
    raise ValueError(f"unknown layer-ops backend {name!r}; known: torch, triton")
