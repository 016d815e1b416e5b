"""Steps replayed from CUDA graphs.

Decode steps: one graph per batch-size bucket (two where the SGMV tilings differ for steps whose
every LoRA segment is one token). Other steps (prefill chunks, alone or with decodes) up to a
token bound: one graph per decoder layer and token-count bucket (`PrefillGraphs`).

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

from collections import Counter
from typing import TypedDict

import torch

from kernels.attention import AttentionBatch, AttentionFn
from kernels.sgmv import SgmvBatch
from replicas.flat_step import FlatStep
from replicas.lora import LoraWeightPool
from replicas.models.llama import LlamaModel, StepContext
from replicas.staging import HostStaging

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Token counts of graph-replayed prefill steps: a step runs as the smallest bucket that holds
# it, so at most a third of a bucket's tokens are padding past 48.
PREFILL_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


class _TensorOptions(TypedDict):
    dtype: torch.dtype
    device: torch.device


class GraphLayout(TypedDict):
    """The keyword arguments `DecodeGraphs` and `PrefillGraphs` share."""

    max_blocks_per_seq: int
    block_size: int
    pad_slot: int
    device: torch.device


class _GraphedSteps:
    """What both kinds of captured step share: the static device buffers their graphs read,
    sized for `tokens` tokens, `seqs` sequences and `segments` LoRA segments; `_stage`, which
    copies a step into their first rows; and `_context`, the step context over those rows that
    a graph captures. Spare sequences have no new tokens and a context of 0, spare segments
    are empty, and padding tokens belong to neither: their key and value go to the pad slot."""

    def __init__(
        self,
        model: LlamaModel,
        lora_pool: LoraWeightPool,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        tokens: int,
        seqs: int,
        segments: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.lora_pool = lora_pool
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.pad_slot = pad_slot
        i32 = _TensorOptions(dtype=torch.int32, device=device)
        i64 = _TensorOptions(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(tokens, **i64)
        self.positions = torch.zeros(tokens, **i64)
        self.slot_mapping = torch.full((tokens,), pad_slot, **i64)
        self.block_table = torch.zeros(seqs, max_blocks_per_seq, **i32)
        self.ctx_lens = torch.zeros(seqs, **i32)
        self.q_starts = torch.arange(seqs + 1, **i32)  # one token a row until a step says else
        self.seg_indptr = torch.zeros(segments + 1, **i32)
        self.seg_slots = torch.zeros(segments, **i32)
        # bucket -> steps replayed from its graphs (a host-side count, for tests and metrics)
        self.replays: Counter[int] = Counter()

    buckets: list[int]  # token counts captured, ascending

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest captured bucket holding `num_tokens` tokens; None: none does."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def _stage(
        self, stage: HostStaging, step: FlatStep, b: int, s: int, k: int, q_starts: bool
    ) -> None:
        """Copy `step` into the buffers' first `b` tokens, `s` sequences and `k` segments
        (non-blocking); `q_starts`: whether the sequences' offsets are staged too (decode steps
        keep one token a row)."""
        n, pad, spare = step.num_tokens, b - step.num_tokens, s - len(step.ctx_lens)
        stage.copy_into(self.input_ids[:b], step.ids + [0] * pad, torch.int64)
        stage.copy_into(self.positions[:b], step.positions + [0] * pad, torch.int64)
        stage.copy_into(self.slot_mapping[:b], step.slot_mapping + [self.pad_slot] * pad,
                        torch.int64)
        if q_starts:
            stage.copy_into(self.q_starts[: s + 1], step.q_starts + [n] * spare, torch.int32)
        stage.copy_into(self.ctx_lens[:s], step.ctx_lens + [0] * spare, torch.int32)
        # Only the real sequences' rows, as wide as the longest: attention reads no block past
        # a context, and spare rows have a context of 0. (Every row at the buffer's width cost
        # the host about a millisecond a step at 64 sequences of an 8k-token max_model_len.)
        rows = step.table_rows()
        stage.copy_into(self.block_table[: len(rows), : len(rows[0])], rows, torch.int32)
        bounds = [0]
        for length in step.seg_lens:
            bounds.append(bounds[-1] + length)
        bounds += [bounds[-1]] * (k + 1 - len(bounds))
        stage.copy_into(self.seg_indptr[: k + 1], bounds, torch.int32)
        slots = step.seg_slots + [0] * (k - len(step.seg_slots))
        stage.copy_into(self.seg_slots[:k], slots, torch.int32)

    def _context(
        self, b: int, s: int, k: int, q_starts: list[int], ctx_lens: list[int],
        one_token: bool, attention: AttentionFn,
    ) -> StepContext:
        """The context over the first `b` tokens, `s` sequences and `k` segments. `q_starts` and
        `ctx_lens` are host stand-ins of those shapes (the kernels read the tensors), as are the
        segments' host lists."""
        attn = AttentionBatch(
            q_starts=q_starts,
            ctx_lens=ctx_lens,
            slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:s],
            ctx_lens_t=self.ctx_lens[:s],
            q_starts_t=self.q_starts[: s + 1],
            block_size=self.block_size,
            sliding_window=self.model.spec.sliding_window,
        )
        pool = self.lora_pool
        lora = SgmvBatch(
            seg_starts=list(range(k)),
            seg_ends=list(range(1, k + 1)),
            seg_slots_host=[0] * k,
            seg_indptr=self.seg_indptr[: k + 1],
            seg_slots=self.seg_slots[:k],
            slot_ranks=pool.ranks,
            slot_scalings=pool.scalings,
            slot_ranks_host=tuple(pool.ranks_host),
            slot_scalings_host=tuple(pool.scalings_host),
            num_tokens=b,
            one_token_segments=one_token,
        )
        return StepContext(attn, lora, self.kv_caches, pool, attention)

    def _settle(self, b: int, ctx: StepContext) -> None:
        """Run bucket `b` eagerly once on a side stream before capturing it: kernels compile
        and allocations settle."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(self.input_ids[:b], self.positions[:b], ctx)
        torch.cuda.current_stream().wait_stream(side)


class DecodeGraphs(_GraphedSteps):
    """Decode steps: one graph per batch-size bucket of one token a sequence, one segment at
    most a token (two graphs where the SGMV tilings differ for steps whose every segment is
    one token)."""

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
        super().__init__(model, lora_pool, kv_caches, max_batch, max_batch, max_batch,
                         max_blocks_per_seq, block_size, pad_slot, device)
        self.attention = attention
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        # Per bucket, a graph for steps whose every LoRA segment is one token (decode over
        # distinct adapters) and, where the SGMV tilings differ for them, one for the rest.
        self.variants = {b: lora_pool.sgmv.graph_variants(b, lora_pool.max_rank)
                         for b in self.buckets}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, bool], torch.Tensor] = {}

    def _decode_context(self, b: int, one_token: bool) -> StepContext:
        return self._context(b, b, b, list(range(b + 1)), [1] * b, one_token, self.attention)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            for one_token in self.variants[b]:
                ctx = self._decode_context(b, one_token)
                self._settle(b, ctx)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[b, one_token] = self.model(
                        self.input_ids[:b], self.positions[:b], ctx
                    )
                self.graphs[b, one_token] = graph
        torch.cuda.synchronize()

    def run(self, stage: HostStaging, step: FlatStep) -> torch.Tensor:
        """Replay the decode graph for the step's sequences (one token each); returns hidden
        states [n, hidden]. The step fits a bucket (`bucket_for`)."""
        n = step.num_tokens
        b = self.bucket_for(n)
        assert b is not None, "the caller checks bucket_for first"
        self._stage(stage, step, b, b, b, q_starts=False)
        one_token = all(length == 1 for length in step.seg_lens)
        key = (b, one_token or len(self.variants[b]) == 1)
        self.graphs[key].replay()
        self.replays[b] += 1
        return self.hidden[key][:n]


class PrefillGraphs(_GraphedSteps):
    """Steps that are not all decodes (prefill chunks, alone or beside decodes) of up to
    `max_tokens` tokens, replayed from CUDA graphs: eager, such a step is bound by the host's
    launches (hundreds of kernels, about 1 ms of host time per layer) while its kernels take a
    fraction of that.

    Per token-count bucket, one graph per decoder layer (the first also embeds the tokens, the
    last applies the final norm), replayed in order. Between two layers the stream waits on that
    layer's adapter-load events, so a prefill still starts while later layers of its adapter are
    on their way (a graph cannot wait on an event recorded outside it).

    The captured shapes: `b` tokens, up to min(b, max_seqs) sequences and min(b, num_slots) LoRA
    segments. Spare sequences have no new tokens and a context of 0, spare segments are empty,
    and padding tokens belong to neither: their key and value go to the pad slot, attention
    leaves their rows as they were, and every other op works row by row, so they touch no real
    row. Attention is always the prefill kernel, which also serves decode rows.
    """

    def __init__(
        self,
        model: LlamaModel,
        lora_pool: LoraWeightPool,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
    ) -> None:
        super().__init__(model, lora_pool, kv_caches, max_tokens, min(max_tokens, max_seqs),
                         min(max_tokens, lora_pool.num_slots), max_blocks_per_seq, block_size,
                         pad_slot, device)
        self.max_seqs = max_seqs
        self.buckets = [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def _shape(self, b: int) -> tuple[int, int]:
        """Sequences and segments of bucket `b`: each feeds at least one token."""
        return min(b, self.max_seqs), min(b, self.lora_pool.num_slots)

    def _prefill_context(self, b: int) -> StepContext:
        from kernels.attention_triton import paged_prefill_attention  # serves decode rows too

        s, k = self._shape(b)
        return self._context(b, s, k, [*range(s), b], [1] * (s - 1) + [b - s + 1], False,
                             paged_prefill_attention)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. A layer's output is the
        next layer's input; the pool may reuse it once that layer has been captured, which is
        safe because the pieces of a step always replay in capture order and every bucket
        writes its activations before reading them."""
        model = self.model
        pool = torch.cuda.graph_pool_handle()
        last = len(model.layers) - 1
        for b in sorted(self.buckets, reverse=True):
            ctx = self._prefill_context(b)
            ids, positions = self.input_ids[:b], self.positions[:b]
            self._settle(b, ctx)
            pieces = []
            x = None
            for i, layer in enumerate(model.layers):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    if i == 0:
                        x = model.embed(ids)
                    x = layer(x, positions, model.rope, ctx, model.ops)
                    if i == last:
                        x = model.final_norm(x)
                pieces.append(graph)
            self.pieces[b] = pieces
            assert x is not None  # the model has at least one layer
            self.hidden[b] = x
        torch.cuda.synchronize()

    def stage_step(self, stage: HostStaging, step: FlatStep) -> int:
        """Copy a step's metadata into the static buffers (non-blocking); returns its bucket.
        The step fits one (`bucket_for`)."""
        b = self.bucket_for(step.num_tokens)
        assert b is not None, "the caller checks bucket_for first"
        self._stage(stage, step, b, *self._shape(b), q_starts=True)
        return b

    def replay(
        self, b: int, n: int, layer_waits: list[list[torch.cuda.Event]] | None = None
    ) -> torch.Tensor:
        """Replay bucket `b`'s layers over the staged step; returns hidden states [n, hidden].
        `layer_waits[L]`: load events layer L waits on, on the device."""
        stream = torch.cuda.current_stream()
        for i, graph in enumerate(self.pieces[b]):
            if layer_waits is not None:
                for event in layer_waits[i]:
                    stream.wait_event(event)
            graph.replay()
        self.replays[b] += 1
        return self.hidden[b][:n]
