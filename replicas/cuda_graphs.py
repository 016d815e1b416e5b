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

import torch

from kernels.attention import AttentionBatch, AttentionFn
from kernels.sgmv import SgmvBatch
from replicas.lora import LoraWeightPool
from replicas.models.llama import LlamaModel, StepContext
from replicas.staging import HostStaging

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Token counts of graph-replayed prefill steps: a step runs as the smallest bucket that holds
# it, so at most a third of a bucket's tokens are padding past 48.
PREFILL_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


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
        _copy_block_tables(stage, self.block_table, tables)
        _copy_segments(stage, self.seg_indptr[: b + 1], self.seg_slots[:b], seg_lens, seg_slots)
        one_token = all(length == 1 for length in seg_lens)
        key = (b, one_token or len(self.variants[b]) == 1)
        self.graphs[key].replay()
        return self.hidden[key][:n]


def _segment_variants(num_tokens: int) -> tuple[bool, ...]:
    """The `one_token_segments` values a bucket needs a graph for: both where either SGMV kernel
    picks another tiling when every segment is one token, else one graph (True) for all."""
    from kernels.sgmv_triton import one_token_variant_differs

    return (True, False) if one_token_variant_differs(num_tokens) else (True,)


class PrefillGraphs:
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
        self.model = model
        self.lora_pool = lora_pool
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.buckets = [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]
        m, s = max_tokens, min(max_tokens, max_seqs)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(m, **i64)
        self.positions = torch.zeros(m, **i64)
        self.slot_mapping = torch.full((m,), pad_slot, **i64)
        self.pad_slot = pad_slot
        self.block_table = torch.zeros(s, max_blocks_per_seq, **i32)
        self.ctx_lens = torch.zeros(s, **i32)
        self.q_starts = torch.zeros(s + 1, **i32)
        n = min(max_tokens, lora_pool.num_slots)
        self.seg_indptr = torch.zeros(n + 1, **i32)
        self.seg_slots = torch.zeros(n, **i32)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def _seqs(self, b: int) -> int:
        return min(b, self.max_seqs)  # every sequence of a step feeds at least one token

    def _segments(self, b: int) -> int:
        return min(b, self.lora_pool.num_slots)

    def _context(self, b: int) -> StepContext:
        s, n = self._seqs(b), self._segments(b)
        attn = AttentionBatch(  # host lists: shapes only (the kernel reads the tensors)
            q_starts=[*range(s), b],
            ctx_lens=[1] * (s - 1) + [b - s + 1],
            slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:s],
            ctx_lens_t=self.ctx_lens[:s],
            q_starts_t=self.q_starts[: s + 1],
            block_size=self.block_size,
            sliding_window=self.model.spec.sliding_window,
        )
        pool = self.lora_pool
        lora = SgmvBatch(
            seg_starts=list(range(n)),
            seg_ends=list(range(1, n + 1)),
            seg_slots_host=[0] * n,
            seg_indptr=self.seg_indptr[: n + 1],
            seg_slots=self.seg_slots[:n],
            slot_ranks=pool.ranks,
            slot_scalings=pool.scalings,
            slot_ranks_host=tuple(pool.ranks_host),
            slot_scalings_host=tuple(pool.scalings_host),
            num_tokens=b,
            one_token_segments=False,
        )
        from kernels.attention_triton import paged_prefill_attention  # serves decode rows too

        return StepContext(attn, lora, self.kv_caches, pool, paged_prefill_attention)

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
            ctx = self._context(b)
            ids, positions = self.input_ids[:b], self.positions[:b]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile kernels and settle allocations first
                model(ids, positions, ctx)
            torch.cuda.current_stream().wait_stream(side)
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
            self.hidden[b] = x
        torch.cuda.synchronize()

    def stage_step(
        self,
        stage: HostStaging,
        ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        q_starts: list[int],
        tables: list[list[int]],
        ctx_lens: list[int],
        seg_lens: list[int],
        seg_slots: list[int],
    ) -> int:
        """Copy a step's metadata into the static buffers (non-blocking); returns its bucket."""
        n = len(ids)
        b = self.bucket_for(n)
        s = self._seqs(b)
        pad = b - n
        stage.copy_into(self.input_ids[:b], ids + [0] * pad, torch.int64)
        stage.copy_into(self.positions[:b], positions + [0] * pad, torch.int64)
        stage.copy_into(self.slot_mapping[:b], slot_mapping + [self.pad_slot] * pad, torch.int64)
        spare = s - len(ctx_lens)
        stage.copy_into(self.q_starts[: s + 1], q_starts + [n] * spare, torch.int32)
        stage.copy_into(self.ctx_lens[:s], ctx_lens + [0] * spare, torch.int32)
        _copy_block_tables(stage, self.block_table, tables)
        k = self._segments(b)
        _copy_segments(stage, self.seg_indptr[: k + 1], self.seg_slots[:k], seg_lens, seg_slots)
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
        return self.hidden[b][:n]


def _copy_block_tables(stage: HostStaging, buf: torch.Tensor, tables: list[list[int]]) -> None:
    """The real sequences' block tables into the first rows of `buf`, as wide as the longest:
    attention reads no block past a sequence's context, and spare rows have a context of 0,
    so stale values elsewhere are never read. (Padding every row to the buffer's width costs
    the host about a millisecond a step at 64 sequences of an 8k-token max_model_len.)"""
    width = max(len(t) for t in tables)
    rows = [t + [0] * (width - len(t)) for t in tables]
    stage.copy_into(buf[: len(tables), :width], rows, torch.int32)


def _copy_segments(
    stage: HostStaging,
    indptr: torch.Tensor,
    slots: torch.Tensor,
    seg_lens: list[int],
    seg_slots: list[int],
) -> None:
    """Segment bounds and slots into static buffers; spare segments are empty."""
    bounds, pos = [0], 0
    for length in seg_lens:
        pos += length
        bounds.append(pos)
    bounds += [pos] * (indptr.numel() - len(bounds))
    stage.copy_into(indptr, bounds, torch.int32)
    stage.copy_into(slots, seg_slots + [0] * (slots.numel() - len(seg_slots)), torch.int32)
