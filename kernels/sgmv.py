"""SGMV: segmented gather matrix-vector products for batched LoRA.

A batch mixes tokens for many adapters. Tokens are grouped by adapter slot into contiguous
segments; tokens of the base model belong to no segment and get no delta. Per layer and projection
group, the LoRA delta is two products:

    shrink:  h[t, i*R:(i+1)*R] = x[t] @ A[slot(t), i*R:(i+1)*R, :]^T                  h: [T, n*R]
    expand:  y[t, o_i:o_{i+1}] += scale[slot(t)] * h[t, i*R:(i+1)*R] @ B[slot(t), o_i:o_{i+1}, :]^T

where `n` slices share one input (q/k/v, or gate/up) and slice `i` writes output columns
[o_i, o_{i+1}). `A` is [num_slots, n*R, in] and `B` is [num_slots, R, sum(out_i)] (rank-major:
each rank index is one contiguous row over the group's output columns, so an adapter of rank r
is r whole rows), with R = max_lora_rank; rows past an adapter's true rank are zero, so any
backend may ignore them.

h is [T, n*R] in x's dtype. Backends subclass `SgmvBackend` (`shrink` and `expand` with the
signatures of the torch reference below; `apply`, the delta of one group, is expand of shrink):
`TorchSgmv` here, `TritonSgmv` in kernels/sgmv_triton.py, which takes the Triton kernels' tuning
(kernels/sgmv_tuning.py). `get_backend` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sgmv_tuning import DEFAULT_TUNING, SgmvTuning


@dataclass(frozen=True)
class SgmvBatch:
    """Per-step LoRA metadata, built once per step and shared by every layer.

    Host lists drive the torch backend (the scheduler knows them on the host, so reading them
    costs no device sync); device tensors drive the Triton kernels.
    """

    seg_starts: list[int]  # host: start token of each segment
    seg_ends: list[int]  # host: end token (exclusive) of each segment
    seg_slots_host: list[int]  # host: slot of each segment
    seg_indptr: torch.Tensor  # [S+1] int32, device: segment boundaries (tokens sorted by slot)
    seg_slots: torch.Tensor  # [S] int32, device: slot of each segment
    slot_ranks: torch.Tensor  # [num_slots] int32, device: true rank per slot (0 = empty)
    slot_scalings: torch.Tensor  # [num_slots] float32, device: lora_alpha / r (or rsLoRA)
    slot_ranks_host: tuple[int, ...]  # host copy of slot_ranks
    slot_scalings_host: tuple[float, ...]  # host copy of slot_scalings
    num_tokens: int
    # Every segment holds one token (a decode step over distinct adapters): a static hint that
    # lets a backend pick tilings for it; results never depend on it. None: from the host lists
    # (a captured CUDA graph sets it for the batches it will replay).
    one_token_segments: bool | None = None

    def __post_init__(self) -> None:
        assert len(self.seg_starts) == len(self.seg_ends) == len(self.seg_slots_host)
        if self.one_token_segments is None:
            one = all(e - s == 1 for s, e in zip(self.seg_starts, self.seg_ends, strict=True))
            object.__setattr__(self, "one_token_segments", one)
        for s, e in zip(self.seg_starts, self.seg_ends, strict=True):
            assert 0 <= s < e <= self.num_tokens, "segments must be non-empty and in range"
        # Checked once per step here rather than in every kernel launch of every layer.
        n = len(self.seg_starts)
        assert self.seg_indptr.shape == (n + 1,) and self.seg_slots.shape == (n,)
        assert self.seg_indptr.dtype == self.seg_slots.dtype == self.slot_ranks.dtype == torch.int32
        assert self.slot_scalings.dtype == torch.float32
        device = self.seg_indptr.device
        for t in (self.seg_indptr, self.seg_slots, self.slot_ranks, self.slot_scalings):
            assert t.device == device and t.is_contiguous(), "metadata: contiguous, one device"

    @property
    def num_segments(self) -> int:
        return len(self.seg_starts)

    @property
    def empty(self) -> bool:
        return not self.seg_starts


def torch_shrink(
    x: torch.Tensor, a: torch.Tensor, batch: SgmvBatch, num_slices: int
) -> torch.Tensor:
    """x: [T, in]; a: [num_slots, n*R, in] -> h: [T, n*R] (zero rows for base tokens)."""
    h = x.new_zeros(x.shape[0], a.shape[1])
    max_rank = a.shape[1] // num_slices
    for s, e, slot in zip(batch.seg_starts, batch.seg_ends, batch.seg_slots_host, strict=True):
        r = batch.slot_ranks_host[slot]
        for i in range(num_slices):
            cols = slice(i * max_rank, i * max_rank + r)
            h[s:e, cols] = x[s:e] @ a[slot, cols].t()
    return h


def torch_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    batch: SgmvBatch,
    y: torch.Tensor,
    out_offsets: tuple[int, ...],
) -> None:
    """h: [T, n*R]; b: [num_slots, R, sum(out_i)]; y: [T, sum(out_i)] updated in place."""
    num_slices = len(out_offsets) - 1
    max_rank = b.shape[1]
    assert h.shape[1] == num_slices * max_rank and y.shape[1] == out_offsets[-1]
    for s, e, slot in zip(batch.seg_starts, batch.seg_ends, batch.seg_slots_host, strict=True):
        r = batch.slot_ranks_host[slot]
        scale = batch.slot_scalings_host[slot]
        for i in range(num_slices):
            o0, o1 = out_offsets[i], out_offsets[i + 1]
            hs = h[s:e, i * max_rank : i * max_rank + r]
            y[s:e, o0:o1] += scale * (hs @ b[slot, :r, o0:o1])


class SgmvBackend:
    """A backend: `shrink` returns h, `expand` adds its delta to y, with the signatures of the
    torch reference above."""

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: SgmvBatch,
               num_slices: int) -> torch.Tensor:
        raise NotImplementedError

    def expand(self, h: torch.Tensor, b: torch.Tensor, batch: SgmvBatch, y: torch.Tensor,
               out_offsets: tuple[int, ...]) -> None:
        raise NotImplementedError

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: SgmvBatch,
              y: torch.Tensor, out_offsets: tuple[int, ...]) -> None:
        """y += the LoRA delta of one group: x [T, in]; a [num_slots, n*R, in]; b [num_slots, R,
        sum(out_i)]. A shrink, then an expand."""
        self.expand(self.shrink(x, a, batch, len(out_offsets) - 1), b, batch, y, out_offsets)

    def graph_variants(self, num_tokens: int, max_rank: int) -> tuple[bool, ...]:
        """The `SgmvBatch.one_token_segments` values a CUDA graph of `num_tokens` tokens in a pool
        of `max_rank` must be captured for: (True,) where one graph serves every batch, (True,
        False) where batches whose every segment is one token launch other kernels."""
        return (True,)


class TorchSgmv(SgmvBackend):
    """The pure-torch reference as a backend (no tuning)."""

    def shrink(self, x, a, batch, num_slices):
        return torch_shrink(x, a, batch, num_slices)

    def expand(self, h, b, batch, y, out_offsets):
        torch_expand(h, b, batch, y, out_offsets)


def get_backend(name: str, tuning: SgmvTuning = DEFAULT_TUNING) -> SgmvBackend:
    """The backend named "torch" (the reference, any device) or "triton" (the kernels under
    `tuning`: their rows and launch switches; needs triton)."""
    if name == "torch":
        return TorchSgmv()
    if name == "triton":
        from kernels.sgmv_triton import TritonSgmv

        return TritonSgmv(tuning)
    raise ValueError(f"unknown SGMV backend {name!r}; known: torch, triton")
