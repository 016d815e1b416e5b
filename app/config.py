"""The application's arguments: the `args:` block of a Serve config YAML, validated with pydantic.

Unknown keys are refused so a typo fails at deploy time instead of being silently ignored. Checks
that need the file system (adapter folders, the model directory) run at build time, in
`app.main.build_app`, on the node that builds the application.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from app.adapters import check_adapter_name
from replicas.config import EngineConfig

DEMO_MODEL_NAME = "lorafleet-demo"
API_KEY_ENV = "LORAFLEET_API_KEY"


def looks_like_local_path(model: str) -> bool:
    """True when `model` names a folder on disk rather than a Hugging Face hub id."""
    return (
        model.startswith(("/", "./", "../", "~"))
        or model == "."
        or Path(model).expanduser().exists()
    )


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        default=None,
        description=(
            "The base model: a local Hugging Face model folder (config.json, safetensors, "
            "tokenizer) or a hub id. null serves the embedded demo model, built on first start."
        ),
    )
    served_model_name: str | None = Field(
        default=None,
        description=(
            "The name clients put in `model` for the base model. Default: the model folder's "
            f"name, the hub id, or {DEMO_MODEL_NAME!r} for the demo."
        ),
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters known at start-up, name -> PEFT folder (adapter_config.json and "
            "adapter_model.safetensors) or Hugging Face Hub repo (org/name, org/name@revision "
            "or hf://org/name[@revision], pinned to the commit it names when the app is built, "
            "downloaded by each engine replica on first use). Each is validated when the "
            "application is built."
        ),
    )
    adapter_root: str | None = Field(
        default=None,
        description=(
            "A folder whose subfolders are adapters, each served under its folder name and "
            "validated the first time a request names it. Must be readable at the same path "
            "from every node."
        ),
    )
    runtime_adapter_dirs: list[str] = Field(
        default_factory=list,
        description=(
            "Folders /v1/load_lora_adapter may load from: lora_path must resolve (symlinks "
            "followed) to a folder inside one of them. Empty: run-time loading is off (403), "
            "except for the demo, which then allows its own adapters folder."
        ),
    )
    hub_adapter_repos: list[str] = Field(
        default_factory=list,
        description=(
            "Hugging Face Hub repos adapters may be fetched from at run time, as glob patterns "
            "over repo ids (myorg/*, org/sql-lora): a request's model naming one "
            "(org/name[@revision]) is served on first use, and /v1/load_lora_adapter takes "
            "lora_path hf://org/name[@revision]. Each is pinned to a commit when first named. "
            "Empty: no adapter is fetched from the hub at run time (403)."
        ),
    )
    max_hub_adapter_gib: float = Field(
        default=2.0,
        gt=0,
        description=(
            "The largest weights file (adapter_model.safetensors) a hub adapter may have, in "
            "GiB; larger ones are refused (400) before they are downloaded."
        ),
    )
    hub_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "How long a request waits on the hub, to pin a hub adapter and then for its "
            "download on an engine replica, before it is answered 503 with Retry-After (a "
            "download goes on, and a later request finds it)."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where engine replicas run. auto: cuda when the Ray cluster has GPUs.",
    )
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description=(
            "Where the base model's weights come from. auto: the model folder's safetensors. "
            "dummy: random weights of the model's shapes (config.json and a tokenizer suffice), "
            "for benchmarks; the text is gibberish."
        ),
    )
    timed_steps: str | None = Field(
        default=None,
        description=(
            "A step calibration (the JSON `python -m sim.calibrate` writes on a GPU): the engine "
            "runs no model, each step takes the calibrated GPU time and samples fixed tokens, on "
            "CPU. For measuring the serving path's own costs without a GPU; the text is "
            "gibberish."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weight and activation dtype. auto: bfloat16 on cuda, float32 on cpu.",
    )
    num_replicas: int = Field(
        default=1, ge=1, description="Engine replicas (one GPU each on cuda)."
    )
    num_ingress_replicas: int | None = Field(
        default=None,
        ge=1,
        description="HTTP ingress replicas (CPU: validation, chat templates, tokenization, "
        "streaming). null: 1 on CPU, 2 per engine replica on GPUs.",
    )
    max_loras_per_batch: int = Field(
        default=8, ge=1, description="GPU adapter slots per engine replica."
    )
    max_loaded_loras: int = Field(
        default=64,
        ge=1,
        description="Adapters in host memory per engine replica (at least max_loras_per_batch).",
    )
    max_loaded_lora_gib: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Also bound the host-memory adapter cache by size, in GiB of weights (adapters of "
            "different ranks differ a hundredfold in size). null: max_loaded_loras alone."
        ),
    )
    max_lora_rank: int = Field(
        default=16, ge=1, description="The largest adapter rank served; higher ranks are refused."
    )
    eviction_policy: Literal["lru", "lfu"] = Field(
        default="lru",
        description=(
            "Which adapter gives up its GPU slot when a new one needs it (never one in use or "
            "pinned). lru: the least recently used. lfu: the least often used, the least "
            "recent among equals."
        ),
    )
    pinned_adapters: list[str] = Field(
        default_factory=list,
        description=(
            "Adapters (names from `adapters`, or the demo's) kept in a GPU slot and in host "
            "memory once loaded: never evicted. At most max_loras_per_batch."
        ),
    )
    adapter_loading: Literal["blocking", "overlap", "prefetch"] | None = Field(
        default=None,
        description=(
            "How engine replicas bring adapters in. blocking: read and copy while the step "
            "waits. overlap: read on worker threads and copy on a load stream while other "
            "requests run. prefetch: overlap, plus loading ahead of need from the waiting queue "
            "and the router's hints. null: prefetch, or overlap when enable_prefetch is false."
        ),
    )
    enable_prefetch: bool = Field(
        default=True,
        description=(
            "Load adapters ahead of need. false means adapter_loading overlap when "
            "adapter_loading is null; an explicit adapter_loading wins (prefetch with "
            "enable_prefetch false is refused as contradictory)."
        ),
    )
    max_num_seqs: int = Field(
        default=64, ge=1, description="Requests running at once per engine replica."
    )
    max_num_batched_tokens: int = Field(
        default=2048,
        ge=1,
        description="Token budget of one engine step (decodes plus prefill chunks).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Context length (prompt + output). null: the model's max_position_embeddings.",
    )
    kv_cache_memory_fraction: float = Field(
        default=0.85,
        gt=0.0,
        le=1.0,
        description="Share of the GPU memory left after weights and adapter slots for KV cache.",
    )
    enforce_eager: bool = Field(
        default=False,
        description=(
            "Run every engine step eagerly: no CUDA graphs (start-up is faster, steps slower)."
        ),
    )
    max_prefill_graph_tokens: int = Field(
        default=1024,
        ge=0,
        description=(
            "Steps with prefill chunks of up to this many tokens replay per-layer CUDA graphs "
            "(captured at start-up for token buckets up to it); larger ones run eagerly, where "
            "the device, not the host, sets their pace. 0: prefill steps always run eagerly."
        ),
    )
    engine_process: bool | None = Field(
        default=None,
        description=(
            "Run each engine replica's engine loop in a child process of its own, exchanging "
            "one message a step with the replica (as vLLM's engine core does), instead of on a "
            "thread of the replica's process, where it shares the GIL with the replica's event "
            "loop and Ray's threads and every step's host work waits for it. Costs a second or "
            "so of start-up and some CPU a token. null: on for cuda (saturated on an H200, "
            "HTTP tok/s 1.08-1.14x the thread's), off on cpu."
        ),
    )
    stream_interval_ms: float = Field(
        default=50.0,
        ge=0.0,
        description=(
            "After a stream's first token (sent at once), its tokens go out at most once per "
            "interval, as one chunk (the last at once); each engine replica sends an ingress "
            "one message per interval for all of that ingress's streams. Each message costs "
            "CPU in the engine replica, the ingress and Serve's proxy. 0: every step's tokens "
            "as they come."
        ),
    )
    max_proxy_chunks_per_s: float = Field(
        default=4000.0,
        ge=0.0,
        description=(
            "Stream chunks a second, after each stream's first, that the engine replicas "
            "sharing one of Serve's proxies (one a node) may send in all; each replica takes "
            "its share. Where its running streams would send more at stream_interval_ms, its "
            "interval grows to fit (at most 0.5 s): chunks carry more tokens and the proxy, "
            "one process that costs about the same a chunk whatever it carries, keeps up. "
            "0: no cap."
        ),
    )
    max_replica_chunks_per_s: float = Field(
        default=1000.0,
        ge=0.0,
        description=(
            "Stream chunks a second, after each stream's first, that one engine replica may "
            "send in all (and within max_proxy_chunks_per_s's share). Where its running streams "
            "would send more at stream_interval_ms, its interval grows to fit (at most 0.5 s): "
            "each chunk costs about the same CPU in the ingress and the proxy whatever it "
            "carries, so a saturated replica's 128 streams send 8 chunks a second each, not 20. "
            "Fewer streams keep stream_interval_ms. 0: no cap."
        ),
    )
    max_ongoing_requests: int = Field(
        default=1024,
        ge=1,
        description=(
            "Requests one engine replica accepts at once (running or queued in its scheduler); "
            "more wait in Serve's routers, which retry with backoff. Well above max_num_seqs: "
            "a burst waits in the engine's queue, admitted the moment there is room."
        ),
    )
    router: Literal["affinity", "pow2"] = Field(
        default="affinity",
        description=(
            "How requests are spread over engine replicas. affinity: to a replica that holds the "
            "request's adapter on its GPU, is loading it or has it in host memory, within a "
            "bound on load imbalance, and the chosen replica is told in advance so it starts "
            "loading. pow2: Ray Serve's default (two random replicas, the shorter queue; "
            "replicas reporting the adapter on GPU first)."
        ),
    )
    router_prefetch_hints: bool = Field(
        default=False,
        description=(
            "With router affinity and adapter_loading prefetch: the router tells the replica it "
            "picked which adapter is coming, before the request gets there, so its prefetcher "
            "can start loading. false (the default: hints have not paid where measured, "
            "docs/perf/routing_sim.md): replicas prefetch from their own queues only."
        ),
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=(
            f"When set, every /v1/ route requires the header `Authorization: Bearer <key>` "
            f"(401 otherwise); /health stays open. null: ${API_KEY_ENV} if set, else no key."
        ),
    )
    max_request_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        description=(
            "Request bodies above this many bytes are refused with 413 before they are parsed. "
            "null: 1 MiB plus 32 bytes per token of max_model_len."
        ),
    )
    demo_cache_dir: str | None = Field(
        default=None,
        description="Where the demo is built. Default: $LORAFLEET_CACHE or ~/.cache/lorafleet.",
    )

    @field_validator("model", "served_model_name", "adapter_root", "demo_cache_dir", "timed_steps")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty string or null")
        return value

    @field_validator("runtime_adapter_dirs")
    @classmethod
    def _folders_non_empty(cls, folders: list[str]) -> list[str]:
        if any(not folder.strip() for folder in folders):
            raise ValueError("folders must be non-empty strings")
        return folders

    @field_validator("hub_adapter_repos")
    @classmethod
    def _repo_patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if pattern.count("/") != 1 or any(c.isspace() for c in pattern):
                raise ValueError(
                    f"{pattern!r} is not a pattern over hub repo ids (org/name, org/*)"
                )
        return patterns

    @field_validator("api_key")
    @classmethod
    def _key_non_empty(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("must be a non-empty string or null")
        return key

    @field_validator("adapters")
    @classmethod
    def _adapter_paths_non_empty(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, path in adapters.items():
            if not path.strip():
                raise ValueError(f"adapter {name!r} has an empty path")
        return adapters

    @field_validator("pinned_adapters")
    @classmethod
    def _pinned_names_once(cls, pinned: list[str]) -> list[str]:
        repeated = sorted({name for name in pinned if pinned.count(name) > 1})
        if repeated:
            raise ValueError(f"adapters pinned more than once: {repeated}")
        return pinned

    @model_validator(mode="after")
    def _check_together(self) -> AppArgs:
        for name in self.adapters:
            check_adapter_name(name, self.base_model_name)
        if len(self.pinned_adapters) > self.max_loras_per_batch:
            raise ValueError(
                f"pinned_adapters lists {len(self.pinned_adapters)} adapters but there are only "
                f"max_loras_per_batch ({self.max_loras_per_batch}) GPU slots"
            )
        if self.model is not None:
            # The demo (model null) brings adapters of its own: build_app checks after merging.
            check_pinned(self.pinned_adapters, self.adapters)
        if self.timed_steps is not None and self.device == "cuda":
            raise ValueError("timed_steps stand in for a GPU: they run on device cpu")
        if self.adapter_loading == "prefetch" and not self.enable_prefetch:
            raise ValueError("adapter_loading prefetch contradicts enable_prefetch false")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least "
                f"max_loras_per_batch ({self.max_loras_per_batch}): every adapter in a GPU slot "
                "is also held in host memory"
            )
        return self

    @property
    def base_model_name(self) -> str:
        """The name of the base model in the API."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model is None:
            return DEMO_MODEL_NAME
        if looks_like_local_path(self.model):
            return Path(self.model).expanduser().resolve().name
        return self.model

    def resolved_api_key(self) -> str | None:
        """`api_key`, else the environment's $LORAFLEET_API_KEY (read where the app is built),
        else None: no key."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None

    def ingress_replicas(self, device: str) -> int:
        """num_ingress_replicas, or its default on `device` ("cpu" or "cuda")."""
        if self.num_ingress_replicas is not None:
            return self.num_ingress_replicas
        return 2 * self.num_replicas if device == "cuda" else 1

    @property
    def max_hub_adapter_bytes(self) -> int:
        return int(self.max_hub_adapter_gib * 2**30)

    @property
    def loading_mode(self) -> str:
        """The engine's adapter loading mode: adapter_loading when given, else from
        enable_prefetch."""
        if self.adapter_loading is not None:
            return self.adapter_loading
        return "prefetch" if self.enable_prefetch else "overlap"

    def to_engine_config(
        self, model_dir: str | Path, device: str, replicas_per_proxy: int = 1
    ) -> EngineConfig:
        """The engine's frozen config, for the model in local folder `model_dir` on `device`
        ("cpu" or "cuda": "auto" is resolved by the caller), one of `replicas_per_proxy` engine
        replicas that share a node's proxy."""
        if replicas_per_proxy < 1:
            raise ValueError("replicas_per_proxy must be at least 1")
        return EngineConfig(
            model=str(model_dir),
            load_format="dummy" if self.load_format == "dummy" else "safetensors",
            device=device,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            enforce_eager=self.enforce_eager,
            engine_process=(
                self.engine_process if self.engine_process is not None else device == "cuda"
            ),
            max_prefill_graph_tokens=self.max_prefill_graph_tokens,
            max_loras_per_batch=self.max_loras_per_batch,
            max_lora_rank=self.max_lora_rank,
            max_loaded_loras=self.max_loaded_loras,
            max_loaded_lora_bytes=(
                None if self.max_loaded_lora_gib is None else int(self.max_loaded_lora_gib * 2**30)
            ),
            adapters=tuple(sorted(self.adapters.items())),
            adapter_root=self.adapter_root,
            hub_timeout_s=self.hub_timeout_s,
            max_hub_adapter_bytes=self.max_hub_adapter_bytes,
            adapter_loading=self.loading_mode,
            pinned_adapters=tuple(self.pinned_adapters),
            eviction_policy=self.eviction_policy,
            timed_steps=self.timed_steps,
            stream_interval_s=self.stream_interval_ms / 1000,
            max_stream_chunks_per_s=self.replica_chunk_budget(replicas_per_proxy),
        )

    def replica_chunk_budget(self, replicas_per_proxy: int = 1) -> float:
        """Chunks a second one engine replica may send: max_replica_chunks_per_s, or its share
        of max_proxy_chunks_per_s if less (0 for either: that cap is off; 0 when both are)."""
        caps = [c for c in (self.max_replica_chunks_per_s,
                            self.max_proxy_chunks_per_s / replicas_per_proxy) if c > 0]  # fmt: skip
        return min(caps, default=0.0)


def args_table() -> str:
    """The README's configuration table: one row per `AppArgs` field, its default and its
    description (tests check that the README shows this table)."""
    rows = ["| arg | default | meaning |", "| --- | --- | --- |"]
    for name, field in AppArgs.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = default if isinstance(default, str) else json.dumps(default)
        rows.append(f"| `{name}` | `{shown}` | {field.description} |")
    return "\n".join(rows)


def check_pinned(pinned: Iterable[str], adapters: Mapping[str, str]) -> None:
    """Raise ValueError unless every pinned name is one of `adapters`."""
    unknown = sorted(set(pinned) - set(adapters))
    if unknown:
        raise ValueError(
            f"pinned_adapters names adapters that are not configured: {unknown}; pin adapters "
            "listed in `adapters`"
        )
