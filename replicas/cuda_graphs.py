"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (two where the SGMV
tilings differ for steps whose every LoRA segment is one token).

A decode step (every sequence feeds one token) has the same kernels every time; only the
contents of a few small tensors change. Each bucket's forward pass is captured once over static
input buffers; a step copies its metadata into those buffers (non-blocking, from pinned memory)
and replays the graph of the smallest bucket that fits. Rows past the real batch are padding:
their context length is 0 (attention skips them), they belong to no LoRA segment, and their key
and value go to a reserved KV block that no request owns.

Needs graph-safe kernels: the Triton decode attention and Triton SGMV read every count from
device tensors and size their grids from static bounds.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionBatch, AttentionFn
from kernels.sgmv import SgmvBatch
from replicas.lora import LoraWeightPool
from replicas.models.llama import LlamaModel, StepContext
from replicas.staging import HostStaging

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        lora_pool: LoraWeightPool,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attention: AttentionFn,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.lora_pool = lora_pool
        self.kv_caches = kv_caches
        self.attention = attention
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.max_blocks = max_blocks_per_seq
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        m = max_batch
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(m, **i64)
        self.positions = torch.zeros(m, **i64)
        self.slot_mapping = torch.full((m,), pad_slot, **i64)
        self.block_table = torch.zeros(m, max_blocks_per_seq, **i32)
        self.ctx_lens = torch.zeros(m, **i32)
        self.q_starts = torch.arange(m + 1, **i32)  # one token per row, always
        self.seg_indptr = torch.zeros(m + 1, **i32)
        self.seg_slots = torch.zeros(m, **i32)
        # Per bucket, a graph for steps whose every LoRA segment is one token (decode over
        # distinct adapters) and, where the SGMV tilings differ for them, one for the rest.
        self.variants = {b: _segment_variants(b) for b in self.buckets}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, bool], torch.Tensor] = {}

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _context(self, b: int, one_token: bool) -> StepContext:
        attn = AttentionBatch(
            q_starts=list(range(b + 1)),  # host shape only: the decode kernel reads the tensors
            ctx_lens=[1] * b,
            slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:b],
            ctx_lens_t=self.ctx_lens[:b],
            q_starts_t=self.q_starts[: b + 1],
            block_size=self.block_size,
            sliding_window=self.model.spec.sliding_window,
        )
        pool = self.lora_pool
        lora = SgmvBatch(  # b segments at most; unused ones are empty (equal bounds)
            seg_starts=list(range(b)),
            seg_ends=list(range(1, b + 1)),
            seg_slots_host=[0] * b,
            seg_indptr=self.seg_indptr[: b + 1],
            seg_slots=self.seg_slots[:b],
            slot_ranks=pool.ranks,
            slot_scalings=pool.scalings,
            slot_ranks_host=tuple(pool.ranks_host),
            slot_scalings_host=tuple(pool.scalings_host),
            num_tokens=b,
            one_token_segments=one_token,
        )
        return StepContext(attn, lora, self.kv_caches, pool, self.attention)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            for one_token in self.variants[b]:
                ctx = self._context(b, one_token)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compile kernels and settle allocations first
                    self.model(self.input_ids[:b], self.positions[:b], ctx)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[b, one_token] = self.model(
                        self.input_ids[:b], self.positions[:b], ctx
                    )
                self.graphs[b, one_token] = graph
        torch.cuda.synchronize()

    def run(
        self,
        stage: HostStaging,
        ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        tables: list[list[int]],
        ctx_lens: list[int],
        seg_lens: list[int],
        seg_slots: list[int],
    ) -> torch.Tensor:
        """Replay the decode graph for len(ids) sequences; returns hidden states [n, hidden]."""
        n = len(ids)
        b = self.bucket_for(n)
        pad = b - n
        stage.copy_into(self.input_ids[:b], ids + [0] * pad, torch.int64)
        stage.copy_into(self.positions[:b], positions + [0] * pad, torch.int64)
        stage.copy_into(self.slot_mapping[:b], slot_mapping + [self.pad_slot] * pad, torch.int64)
        stage.copy_into(self.ctx_lens[:b], ctx_lens + [0] * pad, torch.int32)
        rows = [t + [0] * (self.max_blocks - len(t)) for t in tables] + [
            [0] * self.max_blocks
        ] * pad
        stage.copy_into(self.block_table[:b], rows, torch.int32)
        bounds, pos = [0], 0
        for length in seg_lens:
            pos += length
            bounds.append(pos)
        bounds += [pos] * (b + 1 - len(bounds))
        stage.copy_into(self.seg_indptr[: b + 1], bounds, torch.int32)
        stage.copy_into(self.seg_slots[:b], seg_slots + [0] * (b - len(seg_slots)), torch.int32)
        one_token = all(length == 1 for length in seg_lens)
        key = (b, one_token or len(self.variants[b]) == 1)
        self.graphs[key].replay()
        return self.hidden[key][:n]


def _segment_variants(num_tokens: int) -> tuple[bool, ...]:
    """The `one_token_segments` values a bucket needs a graph for: both where either SGMV kernel
    picks another tiling when every segment is one token, else one graph (True) for all."""
    from kernels.sgmv_triton import one_token_variant_differs

    return (True, False) if one_token_variant_differs(num_tokens) else (True,)
