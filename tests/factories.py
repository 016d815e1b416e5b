"""Small models and adapters for tests, and transformers/PEFT as the reference implementation.

Models come from `synthetic.models.write_llama_model` (seeded, float32, byte tokenizer). Adapters
come from the real peft library, so our loader and kernels are checked against files PEFT itself
wrote (`synthetic.adapters.write_peft_adapter` writes the same format without peft).
`hf_greedy` and `hf_logits` are what our engine's outputs are compared with.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kernels.sgmv import SgmvBatch
from synthetic.adapters import LORA_MODULES
from synthetic.models import write_llama_model
from synthetic.tokenizer import build_byte_tokenizer

# Small enough that a test builds and runs one in well under a second, but with GQA (4 query
# heads over 2 KV heads) and more than one layer, so head grouping and layer indexing are tested.
SMALL_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=256,
    seed=0,
)

# Per-arch differences that our model code must honour: qwen3's head_dim (32) differs from
# hidden_size / num_heads (16), so q_proj is [128, 64] and o_proj is [64, 128].
_ARCH_DEFAULTS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},  # transformers hard-codes bias on q/k/v for Qwen2
    "qwen3": {"head_dim": 32},
}


def make_model(tmp_dir: str | Path, arch: str = "llama", **overrides) -> Path:
    """Write a small `arch` model (llama, mistral, qwen2, qwen3) into `tmp_dir`; return it.

    `overrides` replace any `write_llama_model` argument (e.g. `tie_word_embeddings=True`,
    `seed=3`, `num_layers=3`). The vocabulary is exactly the byte tokenizer's 259 ids unless
    `vocab_size` is given.
    """
    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}")
    tokenizer = build_byte_tokenizer()
    kwargs = {**SMALL_MODEL, **_ARCH_DEFAULTS[arch], "vocab_size": len(tokenizer), **overrides}
    return write_llama_model(tmp_dir, arch=arch, tokenizer=tokenizer, **kwargs)


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    lora_alpha: float | None = None,
    target_modules: Iterable[str] = LORA_MODULES,
    use_rslora: bool = False,
    seed: int = 0,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> Path:
    """Write a LoRA adapter for `model_dir` with peft itself; return `out_dir`.

    `init_lora_weights=False` keeps torch's default Linear init for both A and B (PEFT's default
    would zero B, making the adapter a no-op); the init runs under `seed` without touching the
    caller's global RNG state. `lora_alpha` defaults to `rank` (scaling 1 without rsLoRA).
    `rank_pattern` and `alpha_pattern` go to `LoraConfig` as they are (PEFT's module-name regexes).
    The weights are rounded to bfloat16 values (still saved as float32), like the models', so a
    bf16 engine loads exactly what the float32 reference runs.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=rank if lora_alpha is None else lora_alpha,
        target_modules=sorted(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    base = _load_model(model_dir)
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(param.bfloat16())
    out = Path(out_dir)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def _load_model(model_dir: str | Path, adapter_dir: str | Path | None = None) -> torch.nn.Module:
    """A fresh float32 eval-mode model (with the adapter applied when given).

    Always a fresh load: PEFT injects its layers into the base model in place.
    """
    from transformers import AutoModelForCausalLM

    # eager attention: the plain softmax(QK^T)V reference, with no backend-specific kernels.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    if adapter_dir is not None:
        from peft import PeftModel

        with _quiet_peft():
            model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence the FutureWarning peft triggers in transformers 5 on every wrap; it is not ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        yield


@torch.inference_mode()
def hf_greedy(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    adapter_dir: str | Path | None = None,
) -> list[int]:
    """Exactly `max_new_tokens` greedy tokens after `prompt_ids`, from transformers in float32.

    EOS neither stops generation nor is masked (like `ignore_eos` in vLLM): each step takes the
    plain argmax, so an engine that ignores EOS must produce the same ids.
    """
    from transformers import DynamicCache

    model = _load_model(model_dir, adapter_dir)
    cache = DynamicCache()
    step_input = torch.tensor([prompt_ids], dtype=torch.long)  # [1, S]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True).logits
        next_id = int(logits[0, -1].argmax())
        out.append(next_id)
        step_input = torch.tensor([[next_id]], dtype=torch.long)  # [1, 1]
    return out


@torch.inference_mode()
def hf_logits(
    model_dir: str | Path,
    input_ids: list[int],
    adapter_dir: str | Path | None = None,
) -> torch.Tensor:
    """Logits of one forward pass over `input_ids`: [seq, vocab] float32."""
    model = _load_model(model_dir, adapter_dir)
    return model(input_ids=torch.tensor([input_ids], dtype=torch.long)).logits[0].float()


def sgmv_batch(
    lens: list[int], slots: list[int], ranks: tuple[int, ...], scalings: tuple[float, ...], device
) -> SgmvBatch:
    """SGMV metadata for segments of `lens` tokens laid end to end from token 0, segment i on
    slot `slots[i]`; slot s has rank `ranks[s]` and scaling `scalings[s]`."""
    ends = [sum(lens[: i + 1]) for i in range(len(lens))]
    return SgmvBatch(
        seg_starts=[e - n for e, n in zip(ends, lens, strict=True)],
        seg_ends=ends,
        seg_slots_host=list(slots),
        seg_indptr=torch.tensor([0, *ends], dtype=torch.int32, device=device),
        seg_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        slot_scalings=torch.tensor(scalings, dtype=torch.float32, device=device),
        slot_ranks_host=tuple(ranks),
        slot_scalings_host=tuple(scalings),
        num_tokens=ends[-1],
    )


@torch.inference_mode()
def hf_greedy_many(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    adapter_dir: str | Path | None = None,
) -> list[list[int]]:
    """`hf_greedy` for several prompts over one load of the model (and adapter): the same ids,
    for tests that need many references. Greedy tokens for fewer new tokens are a prefix."""
    from transformers import DynamicCache

    model = _load_model(model_dir, adapter_dir)
    outs = []
    for prompt_ids in prompts:
        cache = DynamicCache()
        step_input = torch.tensor([prompt_ids], dtype=torch.long)  # [1, S]
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=step_input, past_key_values=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            step_input = torch.tensor([[out[-1]]], dtype=torch.long)  # [1, 1]
        outs.append(out)
    return outs


def copy_model(model_dir: str | Path, out_dir: str | Path, **config_changes) -> Path:
    """Copy a model folder into `out_dir` with `config_changes` written into its config.json
    (e.g. `sliding_window=8`): the same weights under another config. Returns `out_dir`."""
    import json
    import shutil

    out = Path(out_dir)
    shutil.copytree(model_dir, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(config_changes)
    config_path.write_text(json.dumps(config, indent=2))
    return out


def save_sharded(model_dir: str | Path, out_dir: str | Path, max_shard_size: str) -> Path:
    """Save `model_dir`'s model again with transformers, in shards of at most `max_shard_size`
    (with model.safetensors.index.json), beside its tokenizer and generation config."""
    import shutil

    out = Path(out_dir)
    _load_model(model_dir).save_pretrained(
        out, max_shard_size=max_shard_size, safe_serialization=True
    )
    for path in Path(model_dir).iterdir():
        if path.suffix != ".safetensors" and not (out / path.name).exists():
            shutil.copy(path, out / path.name)
    return out


def reference_model(model_dir: str | Path, adapter_dir: str | Path | None = None):
    """The transformers (+ PEFT) model the references run, for tests that inspect its modules
    (a PEFT layer's `r` and `scaling`): float32, eager attention, eval mode, a fresh load."""
    return _load_model(model_dir, adapter_dir)
