"""Hugging Face model folders of Llama-family shapes with seeded random weights.

`write_llama_model` writes real weights (config.json, model.safetensors, tokenizer), the same
bytes in every process, so transformers can serve as the reference; `write_model` writes only
config.json and a tokenizer, for `load_format: dummy` at any size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from synthetic.tokenizer import build_byte_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _config_classes() -> dict[str, type]:
    # Imported on use: transformers takes seconds to import, and the app imports this module
    # even when the demo is built already.
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }
    assert tuple(classes) == ARCHS
    return classes


def write_llama_model(
    out_dir: str | Path,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    max_position_embeddings: int,
    seed: int,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    tokenizer: PreTrainedTokenizerFast | None = None,
    head_dim: int | None = None,
    initializer_range: float = 0.04,
) -> Path:
    """Write a Hugging Face model folder with seeded random float32 weights; return its path.

    `arch` picks the config class: "llama", "mistral", "qwen2" (bias on q/k/v) or "qwen3" (q/k
    RMSNorm; `head_dim` may differ from hidden_size / num_heads). The folder holds config.json,
    model.safetensors, generation_config.json (EOS set) and the tokenizer (the byte tokenizer when
    none is given; `vocab_size` must cover it).

    Weights come from a private generator seeded with `seed`, not from transformers' init or the
    global torch RNG, so the bytes are the same in every process and thread (see `_fill_seeded`
    for the scales). Biases are non-zero and norm scales are not all 1, so a reimplementation that
    drops a bias or a norm weight disagrees with transformers; attention is sharp enough that
    greedy decoding depends on the context instead of repeating one token. Rows for ids past the
    tokenizer (when `vocab_size` is rounded up) are zero, so their logit is 0, almost surely below
    the best of the real logits: greedy does not pick them, though sampling can (they decode to
    nothing).
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    tokenizer = tokenizer if tokenizer is not None else build_byte_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")

    config_kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if head_dim is not None:
        config_kwargs["head_dim"] = head_dim
    config = _config_classes()[arch](**config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_seeded(model.named_parameters(), seed=seed, std=initializer_range)
    _zero_padding_rows(model, first_padding_id=len(tokenizer))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    return out


# Scales found by trying (greedy runs from several prompts, and bf16-vs-bf16 logits). With every
# matrix at initializer_range, attention in a narrow model is a near-uniform average of the
# context and greedy decoding settles into repeating one token. Attention logits with std
# _ATTENTION_LOGIT_STD, whatever the width, break that; much sharper attention would amplify
# rounding, and bf16 runs would drift from the float32 reference far more than trained models do.
_ATTENTION_LOGIT_STD = 3.0
_NORM_NOISE = 0.1


def _fill_seeded(named_parameters: Iterable[tuple[str, Any]], *, seed: int, std: float) -> None:
    """Overwrite every parameter from one generator, in name order, so the result is reproducible.

    Embeddings, biases and matrices are N(0, std), except q/k projections: N(0, sqrt(L / fan_in))
    with L = _ATTENTION_LOGIT_STD, so q.k / sqrt(head_dim) has std about L for unit-RMS inputs
    (q/k norm scales, in Qwen3, are sqrt(L) for the same effect). Norm scales are
    1 + N(0, _NORM_NOISE); the final norm's also get random signs, because with tied embeddings
    the current token's own embedding, still in the residual stream, would otherwise win the
    logits at every step and the model would repeat its input token forever.
    Every value is a bfloat16 number, so loading in bfloat16 is exact and a bf16 run differs from
    the float32 reference only by activation rounding.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(named_parameters, key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            module = name.rsplit(".", 2)[-2]
            if name.endswith(".bias"):
                value = noise * std
            elif param.ndim >= 2 and module in ("q_proj", "k_proj"):
                value = noise * math.sqrt(_ATTENTION_LOGIT_STD / param.shape[1])
            elif param.ndim >= 2:
                value = noise * std
            elif module in ("q_norm", "k_norm"):
                value = (1.0 + _NORM_NOISE * noise) * math.sqrt(_ATTENTION_LOGIT_STD)
            else:  # RMSNorm scales: around 1, but not exactly, so a dropped scale shows
                value = 1.0 + _NORM_NOISE * noise
                if name == "model.norm.weight":
                    signs = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
                    value = value * signs
            param.copy_(value.to(torch.bfloat16))


def _zero_padding_rows(model: Any, *, first_padding_id: int) -> None:
    """Zero the embedding and output rows of ids that no token maps to, as untrained rows are."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[first_padding_id:] = 0.0
        model.get_output_embeddings().weight[first_padding_id:] = 0.0


def write_model(root: Path, model_config: Mapping[str, Any]) -> Path:
    """A model folder `root / "model"` the engine can serve with `load_format: dummy`: config.json
    and a tokenizer for the whole vocabulary. The tokenizer is the byte-level one (prompts of
    token ids below 256 are valid for it) plus one plain word per id above it, so whatever id
    random weights pick decodes to text and streams as a chunk of its own."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens([f" x{i}" for i in range(len(tokenizer), model_config["vocab_size"])])
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(dict(model_config)))
    save_tokenizer(tokenizer, model_dir)
    return model_dir
