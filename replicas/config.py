"""Frozen engine configuration. Built once from the app's pydantic args; never mutated.

Values discovered at run time (number of KV blocks, the model's own context length) live on the
runtime objects that discover them, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.adapters.modes import LOADING_MODES


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local Hugging Face model directory (config.json + safetensors)
    load_format: str = "safetensors"  # or "dummy": random weights of the right shapes (benchmarks)
    device: str = "cpu"  # "cpu" or "cuda" (resolved from "auto" before the engine is built)
    dtype: str = (
        "auto"  # "auto" (bfloat16 on cuda, float32 on cpu), "float32", "bfloat16", "float16"
    )
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget per step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction / the CPU default
    kv_cache_memory_fraction: float = 0.85  # of free GPU memory, after weights and adapter slots
    # KV headroom kept for running requests' outputs when admitting (replicas/scheduler.py); it
    # decays to a tenth of this while no preemption happens. 0: admit whenever a chunk fits.
    kv_reserve_ratio: float = 0.5
    max_loras_per_batch: int = 8  # GPU adapter slots
    max_lora_rank: int = 16
    max_loaded_loras: int = 64  # adapters kept in host memory
    max_loaded_lora_bytes: int | None = None  # and at most this many bytes of them
    adapter_loading: str = "prefetch"  # "blocking", "overlap", "prefetch": adapters/modes.py
    eviction_policy: str = "lru"  # GPU slots: "lru" or "lfu" (adapters/slot_pool.py)
    pinned_adapters: tuple[str, ...] = ()  # never evicted from GPU slots or host memory
    # (name, path) known at start-up; a path may be a hub adapter, `hf://org/name@<commit>`
    adapters: tuple[tuple[str, str], ...] = ()
    adapter_root: str | None = None  # folder whose subfolders are adapters, found on first use
    hub_timeout_s: float = 30.0  # the most a request waits on a hub adapter's download
    max_hub_adapter_bytes: int = 2 << 30  # a hub adapter's weights file, at most
    sgmv_backend: str = (
        "auto"  # "auto" (triton on cuda when available, else torch), "torch", "triton"
    )
    attention_backend: str = "auto"  # like sgmv_backend
    layer_ops_backend: str = "auto"  # norms, activation, rotary (kernels/layer_ops.py): as above
    enforce_eager: bool = False  # True: never replay steps from CUDA graphs
    # Steps with prefill chunks of up to this many tokens replay per-layer CUDA graphs
    # (replicas/cuda_graphs.py); larger ones run eagerly. 0: prefill steps always run eagerly.
    max_prefill_graph_tokens: int = 1024
    # A simulator calibration (sim.calibrate's JSON): no model; each step sleeps its calibrated
    # time and samples fixed tokens (replicas/timed_runner.py), to measure the served path on CPU.
    timed_steps: str | None = None
    stream_interval_s: float = 0.05  # a stream's chunks after its first: at most one per interval
    # Chunks a second this replica's streams may send in all after their first (0: no cap): the
    # interval grows past stream_interval_s to fit (`AsyncEngine.chunk_interval`).
    max_stream_chunks_per_s: float = 0.0
    # Run the engine's loop in a child process of its own (replicas/engine_process.py) rather
    # than on a thread sharing the replica's GIL with its event loop and Ray's threads.
    engine_process: bool = False
    warm_up: bool = True  # CUDA: run every step shape once at start-up (kernels compile then)
    seed: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())  # extra EOS ids beyond the model's own

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_loras_per_batch",
            "max_lora_rank",
            "max_loaded_loras",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.adapter_loading not in LOADING_MODES:
            raise ValueError(f"unknown adapter_loading {self.adapter_loading!r}")
        if self.max_loaded_lora_bytes is not None and self.max_loaded_lora_bytes < 1:
            raise ValueError("max_loaded_lora_bytes must be positive")
        if self.eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction_policy {self.eviction_policy!r}")
        if not 0.0 <= self.kv_reserve_ratio <= 1.0:
            raise ValueError("kv_reserve_ratio must be in [0, 1]")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError("max_prefill_graph_tokens must be at least 0")
        if self.hub_timeout_s <= 0 or self.max_hub_adapter_bytes < 1:
            raise ValueError("hub_timeout_s and max_hub_adapter_bytes must be positive")
        if self.stream_interval_s < 0:
            raise ValueError("stream_interval_s cannot be negative")
        if self.max_stream_chunks_per_s < 0:
            raise ValueError("max_stream_chunks_per_s cannot be negative")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")

    @property
    def adapter_paths(self) -> dict[str, str]:
        return dict(self.adapters)
