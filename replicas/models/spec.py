"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`.

Read from the JSON itself rather than a transformers config object, so configs written by old and
new transformers releases (`rope_theta` + `rope_scaling`, or `rope_parameters`) both load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # "default", "linear", "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_dims(self, target: str) -> tuple[int, int]:
        """(in_features, out_features) of one LoRA-able projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[target]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json")
        cfg = json.loads(path.read_text())
        eos = _eos_ids(cfg, Path(model_dir))
        return cls.from_dict(cfg, eos)

    @classmethod
    def from_dict(cls, cfg: dict, eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        window = _sliding_window(cfg, model_type)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            sliding_window=window,
            eos_token_ids=eos_token_ids,
        )


# Qwen2Config's and Qwen3Config's default: with `use_sliding_window`, layers from this one on slide.
QWEN_MAX_WINDOW_LAYERS = 28


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """The attention window of every layer (None: full attention), where transformers applies
    one: Mistral on every layer; Qwen2/Qwen3 only with `use_sliding_window`, on the layers that
    `layer_types` marks "sliding_attention" (older configs: from `max_window_layers` on).
    Raises ValueError for a model whose layers mix windowed and full attention."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None
        if layer_types is None:
            first = cfg.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
            layer_types = [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
    if window is None or layer_types is None:
        return window
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise ValueError(
        f"layer_types {sorted(kinds)}: layers mixing sliding-window and full attention are not "
        "supported (every layer must use the same)"
    )


def _rope(cfg: dict) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3)")
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(cfg: dict, model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    sources = [cfg.get("eos_token_id")]
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
