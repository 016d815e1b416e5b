"""Rotary position embeddings (the half-split layout Llama, Mistral and Qwen checkpoints use)."""

from __future__ import annotations

import math

import torch

from replicas.models.spec import RopeSpec


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if spec.kind == "linear":
        inv = inv / spec.factor
    elif spec.kind == "llama3":
        # Llama 3.1 long-context scaling: long wavelengths are divided by `factor`, short ones kept,
        # and the band between them interpolated smoothly.
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        blended = (1 - smooth) * inv / spec.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, inv)
    return inv.float()


class RotaryEmbedding(torch.nn.Module):
    """The cos and sin tables per position, [P, D/2] float32. The rotation itself is a layer op
    (kernels/layer_ops.py: `rotary`)."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, spec: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv = inverse_frequencies(spec, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)
