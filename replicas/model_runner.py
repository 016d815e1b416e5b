"""Runs one scheduled step on the device: builds the flat batch, runs the model, samples.

Token order inside a step: sequences with an adapter first, grouped by slot (so each slot's
tokens form one SGMV segment), then base-model sequences.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable

import torch

from kernels.attention import AttentionBatch, get_attention_backend
from kernels.layer_ops import get_layer_ops
from replicas.config import EngineConfig
from replicas.cuda_graphs import DecodeGraphs, GraphLayout, PrefillGraphs
from replicas.flat_step import FlatStep, lay_out
from replicas.kv_cache import blocks_for
from replicas.lora import LoraWeightPool
from replicas.models.llama import StepContext
from replicas.models.spec import ModelSpec
from replicas.models.weights import load_model, random_model
from replicas.sampler import Sampler
from replicas.scheduler import ScheduledSeq
from replicas.staging import HostStaging

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 1 << 30
# Step sizes run once at start-up on CUDA (`warm_up`): every SGMV tuning row, Triton's integer
# specializations (1, multiples of 16, others) and the largest step, so that kernels compile
# before the first request instead of stalling it.
WARM_UP_TOKENS = (2, 16, 17, 100, 128, 129, 300, 512, 513, 1000, 2048)


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    return DTYPES[config.dtype]


def resolve_backend(setting: str, device: str, triton_module: str) -> str:
    """A kernel backend for an EngineConfig `*_backend` field: the setting itself unless
    "auto"; for "auto", torch on CPU and Triton on CUDA when `triton_module` imports."""
    if setting != "auto":
        return setting
    if device == "cpu":
        return "torch"
    try:
        importlib.import_module(triton_module)
    except ImportError:
        return "torch"
    return "triton"


def warm_up_segment_counts(num_slots: int) -> list[int]:
    """LoRA segment counts whose steps compile every SGMV kernel variant a step of 1 to
    `num_slots` segments launches. The kernels specialize on the count's table width (`BLOCK_S`,
    a power of two, at least 16) and, as Triton does with an integer argument, on the count
    being 1 or a multiple of 16: one count of each pair 1..num_slots reaches. With 32 slots:
    1, 2, 16, 17, 32 (warming 1, 2 and 32 alone left 3-15 and 17-31 segments to compile while
    serving; what that cost: docs/perf/serving.md)."""
    seen: set[tuple[int, bool, bool]] = set()
    counts = []
    for n in range(1, num_slots + 1):
        kind = (max(16, 1 << (n - 1).bit_length()), n == 1, n % 16 == 0)
        if kind not in seen:
            seen.add(kind)
            counts.append(n)
    return counts


def size_key(num_tokens: int, tuning, max_rank: int) -> tuple:
    """What a step's token count changes in its kernels' compiled variants: the SGMV tilings
    `tuning` picks for a prefill step of that size (None: no tilings, e.g. no Triton), and
    Triton's specialization of an integer argument (1, a multiple of 16, or neither)."""
    tilings = () if tuning is None else (
        tuning.shrink_tiling(num_tokens, False, max_rank),
        tuning.expand_tiling(num_tokens, False, max_rank),
    )
    return (*tilings, num_tokens == 1, num_tokens % 16 == 0)


def warm_up_steps(
    max_tokens: int,
    max_model_len: int,
    num_slots: int,
    graph_bound: int,
    key: Callable[[int], tuple],
) -> list[tuple[int, list[int], list[int]]]:
    """The dummy steps that compile every kernel variant an eager step can launch: for one size
    of each `key` class above `graph_bound` (the prefill graphs' largest bucket; 0 without) up
    to `max_tokens`, one step of each segment count in `warm_up_segment_counts` and of
    `num_slots`. Each is (tokens, sequence lengths, LoRA segment lengths): as few sequences as
    `max_model_len` allows and at least one a segment, consecutive sequences sharing a segment
    as one adapter's requests do. (A step of 1,500 tokens is two sequences at 1,024 tokens a
    sequence, yet one segment when they share an adapter: with sequences and segments one to
    one, that case was never warmed and compiled while serving, 42% of an H200 engine
    replica's samples in a one-adapter burst.)"""
    classes: dict[tuple, int] = {}
    for n in range(graph_bound + 1, max_tokens + 1):
        classes.setdefault(key(n), n)
    # ...and the sizes the attention kernels have been warmed with all along.
    listed = {min(t, max_tokens) for t in (*WARM_UP_TOKENS, max_tokens)}
    sizes = {*classes.values(), *(n for n in listed if n > graph_bound)}
    counts = sorted({*warm_up_segment_counts(num_slots), num_slots})
    steps = []
    for n in sorted(sizes):
        fewest = -(-n // max_model_len)  # no dummy sequence longer than the model allows
        for k in counts:
            num_seqs = max(k, fewest)
            if num_seqs > n:
                continue
            lengths = [n // num_seqs + (i < n % num_seqs) for i in range(num_seqs)]
            segments = [*lengths[: k - 1], sum(lengths[k - 1 :])]
            steps.append((n, lengths, segments))
    return steps


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, max_model_len: int) -> None:
        self.config = config
        self.spec = spec
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        ops = get_layer_ops(
            resolve_backend(config.layer_ops_backend, config.device, "kernels.layer_ops_triton")
        )
        if config.load_format == "dummy":
            self.model = random_model(
                spec, self.dtype, self.device, max_model_len, config.seed, ops
            )
        else:
            self.model = load_model(
                config.model, spec, self.dtype, self.device, max_model_len, ops
            )
        self.lora_pool = LoraWeightPool(
            spec,
            config.max_loras_per_batch,
            config.max_lora_rank,
            self.dtype,
            self.device,
            backend=resolve_backend(config.sgmv_backend, config.device, "kernels.sgmv_triton"),
        )
        self.num_kv_blocks = self._num_kv_blocks(max_model_len)
        # One block past those the allocator hands out takes the keys and values of padding
        # rows in graph-replayed decode steps.
        self.pad_slot = self.num_kv_blocks * config.block_size
        shape = (self.num_kv_blocks + 1, config.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(spec.num_layers)
        ]
        self.sampler = Sampler(self.device, config.seed)
        self.staging = HostStaging(self.device)
        self.last_launch_s = 0.0  # host time of the last step up to its readback
        self.attention_backend = resolve_backend(
            config.attention_backend, config.device, "kernels.attention_triton"
        )
        self.attention = get_attention_backend(self.attention_backend)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.attention_backend == "triton"
            and self.lora_pool.backend == "triton"
        ):
            shared = GraphLayout(
                max_blocks_per_seq=blocks_for(max_model_len, config.block_size),
                block_size=config.block_size,
                pad_slot=self.pad_slot,
                device=self.device,
            )
            self.graphs = DecodeGraphs(self.model, self.lora_pool, self.kv_caches,
                                       self.attention, max_batch=config.max_num_seqs, **shared)
            self.graphs.capture()
            max_tokens = min(config.max_prefill_graph_tokens, config.max_num_batched_tokens)
            if max_tokens > 0:
                self.prefill_graphs = PrefillGraphs(
                    self.model, self.lora_pool, self.kv_caches, max_tokens=max_tokens,
                    max_seqs=config.max_num_seqs, **shared,
                )
                self.prefill_graphs.capture()
        self._generators: dict[str, torch.Generator] = {}
        if self.device.type == "cuda" and config.warm_up:
            self.warm_up(config.max_num_batched_tokens, max_model_len)
        logger.info(
            "model runner ready: %d KV blocks of %d tokens on %s (%s)",
            self.num_kv_blocks,
            config.block_size,
            self.device,
            self.dtype,
        )

    def _kv_block_bytes(self) -> int:
        s = self.spec
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.config.block_size * s.num_kv_heads * s.head_dim * itemsize

    def _num_kv_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = int(free * self.config.kv_cache_memory_fraction) // self._kv_block_bytes()
        else:
            wanted = self.config.max_num_seqs * blocks_for(max_model_len, self.config.block_size)
            blocks = min(wanted, CPU_KV_CACHE_BYTES // self._kv_block_bytes())
        needed = blocks_for(max_model_len, self.config.block_size)
        if blocks < needed:
            raise ValueError(
                f"the KV cache holds {blocks} blocks of {self.config.block_size} tokens, fewer "
                f"than one sequence of max_model_len {max_model_len} needs ({needed}); lower "
                f"max_model_len or give the cache more memory"
            )
        return blocks

    def _size_key(self, num_tokens: int) -> tuple:
        """What a step's token count changes in the kernels it launches (`size_key`)."""
        return size_key(num_tokens, getattr(self.lora_pool.sgmv, "tuning", None),
                        self.lora_pool.max_rank)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, max_model_len: int) -> None:
        """Run the eager forward pass over every kind of step the kernels compile for
        (`warm_up_steps`: each size class above the prefill graphs' largest bucket, by each
        segment-count class). Every key and value goes to the pad slot and every block table
        points at the pad block, so no request's cache is touched; outputs are discarded."""
        bs, pad_block = self.config.block_size, self.num_kv_blocks
        graphs = self.prefill_graphs
        # Capturing the graphs compiled the kernels of the sizes they cover.
        bound = graphs.buckets[-1] if graphs is not None else 0
        for n, lengths, segments in warm_up_steps(
            max_tokens, max_model_len, self.lora_pool.num_slots, bound, self._size_key
        ):
            positions = [p for length in lengths for p in range(length)]
            q_starts = [0]
            for length in lengths:
                q_starts.append(q_starts[-1] + length)
            self.staging.reset()  # no readback here: the last pass's copies are fenced
            self._forward(self.staging, FlatStep(
                ids=[0] * n,
                positions=positions,
                slot_mapping=[self.pad_slot] * n,
                q_starts=q_starts,
                ctx_lens=lengths,
                tables=[[pad_block] * blocks_for(length, bs) for length in lengths],
                seg_lens=segments,
                seg_slots=list(range(len(segments))),
            ))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # start-up, not a step: the staging is reused

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[ScheduledSeq],
        layer_waits: list[list[torch.cuda.Event]] | None = None,
        while_running: Callable[[], bool] | None = None,
    ) -> list[int]:
        """Run one step. Returns the sampled token of every seq whose `samples` is true, in the
        order of `seqs`. `layer_waits[L]` are adapter-load events layer L must wait on.
        `while_running()` runs once every launch is enqueued and, while it returns True, again
        every few hundred microseconds until the step's tokens are back (HostStaging.readback)."""
        started = time.monotonic()
        order, step = lay_out(seqs, self.config.block_size)
        q_starts = step.q_starts
        num_tokens = step.num_tokens
        stage = self.staging
        stage.reset()  # free: the previous step's readback waited for its copies
        graphs, prefill = self.graphs, self.prefill_graphs
        if graphs is not None and num_tokens == len(seqs) and graphs.bucket_for(num_tokens):
            if layer_waits is not None:  # a graph cannot wait per layer: wait for whole loads
                stream = torch.cuda.current_stream(self.device)
                for event in layer_waits[-1]:
                    stream.wait_event(event)
            hidden = graphs.run(stage, step)
        elif prefill is not None and prefill.bucket_for(num_tokens):
            hidden = prefill.replay(prefill.stage_step(stage, step), num_tokens, layer_waits)
        else:
            hidden = self._forward(stage, step, layer_waits)
        rows = [k for k, i in enumerate(order) if seqs[i].samples]
        if not rows:
            self.last_launch_s = time.monotonic() - started
            if while_running is not None:
                while_running()
            return []
        last = stage.tensor([q_starts[k + 1] - 1 for k in rows], torch.int64)
        logits = self.model.logits(hidden[last])
        sampled = [seqs[order[k]] for k in rows]
        tokens = self.sampler.sample(
            logits,
            [s.request.sampling for s in sampled],
            [self._generator(s) for s in sampled],
            stage.tensor,
        )
        self.last_launch_s = time.monotonic() - started  # every launch issued, none waited on
        by_seq = dict(
            zip((order[k] for k in rows), stage.readback(tokens, while_running), strict=True)
        )
        return [by_seq[i] for i in sorted(by_seq)]

    def _forward(
        self,
        stage: HostStaging,
        step: FlatStep,
        layer_waits: list[list[torch.cuda.Event]] | None = None,
    ) -> torch.Tensor:
        """The eager forward pass over any mix of prefill chunks and decodes."""
        attn = AttentionBatch(
            q_starts=step.q_starts,
            ctx_lens=step.ctx_lens,
            slot_mapping=stage.tensor(step.slot_mapping, torch.int64),
            block_table=stage.tensor(step.table_rows(), torch.int32),
            ctx_lens_t=stage.tensor(step.ctx_lens, torch.int32),
            q_starts_t=stage.tensor(step.q_starts, torch.int32),
            block_size=self.config.block_size,
            sliding_window=self.spec.sliding_window,
        )
        ctx = StepContext(
            attn=attn,
            lora=self.lora_pool.make_batch(
                step.seg_lens, step.seg_slots, step.num_tokens, stage.tensor
            ),
            kv_caches=self.kv_caches,
            lora_pool=self.lora_pool,
            attention=self.attention,
            layer_waits=layer_waits,
        )
        ids = stage.tensor(step.ids, torch.int64)
        return self.model(ids, stage.tensor(step.positions, torch.int64), ctx)

    def _generator(self, seq: ScheduledSeq) -> torch.Generator | None:
        req = seq.request
        if req.sampling.seed is None or req.sampling.greedy:
            return None
        if req.request_id not in self._generators:
            self._generators[req.request_id] = self.sampler.make_generator(req.sampling.seed)
        return self._generators[req.request_id]

