"""LoRA adapters in PEFT's format with seeded random, non-zero weights (peft itself not needed).

`write_peft_adapter` writes one adapter for a model folder; `write_fleet` writes many adapters
that share a few weight files, for benchmarks that need hundreds at Llama-3-8B sizes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.models.spec import ModelSpec

# PEFT's key layout: `base_model.model.` + the transformers parameter path + `.lora_{A,B}.weight`.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES


def _lora_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able projection, from a model's config.json."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def lora_scaling(rank: int, lora_alpha: float, use_rslora: bool) -> float:
    """The factor PEFT applies to B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return lora_alpha / (math.sqrt(rank) if use_rslora else rank)


def write_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    lora_alpha: float,
    target_modules: Iterable[str],
    seed: int,
    use_rslora: bool = False,
    init_scale: float = 0.3,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a LoRA adapter in PEFT's format for the model in `model_dir`; return `out_dir`.

    The folder holds adapter_config.json and adapter_model.safetensors, as
    `PeftModel.save_pretrained` writes them (peft itself is not needed). Every layer gets
    A [r, in] and B [out, r] for each of `target_modules` (a subset of q/k/v/o/gate/up/down_proj),
    both random and non-zero, from a private generator seeded with `seed`.

    `init_scale` sets the size of the adapter's effect independently of rank and alpha: for an
    input with unit RMS, scaling * B @ A @ x has RMS about `init_scale`. The default is large
    enough that adapters visibly change greedy outputs of `write_llama_model` models.
    `base_model_name_or_path` defaults to `str(model_dir)`.
    """
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    shapes = _lora_shapes(config)
    targets = sorted(set(target_modules))
    unknown = [t for t in targets if t not in shapes]
    if unknown or not targets:
        raise ValueError(f"target_modules must be a non-empty subset of {LORA_MODULES}: {unknown}")
    if rank < 1:
        raise ValueError(f"rank must be positive, got {rank}")

    scaling = lora_scaling(rank, lora_alpha, use_rslora)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            in_features, out_features = shapes[module]
            prefix = _module_prefix(layer, module)
            # A maps a unit-RMS input to unit-RMS rank features; B is scaled so that after
            # PEFT's scaling the delta's RMS is init_scale.
            lora_a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            lora_b = torch.randn(out_features, rank, generator=generator)
            lora_b *= init_scale / (math.sqrt(rank) * scaling)
            # bfloat16 values stored as float32, as for the model: loading in bf16 is exact.
            tensors[f"{prefix}.lora_A.weight"] = lora_a.bfloat16().float()
            tensors[f"{prefix}.lora_B.weight"] = lora_b.bfloat16().float()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = _peft_lora_config(
        base_model_name_or_path=base_model_name_or_path or str(model_dir),
        rank=rank,
        lora_alpha=lora_alpha,
        target_modules=targets,
        use_rslora=use_rslora,
    )
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    return out


def _peft_lora_config(
    *,
    base_model_name_or_path: str,
    rank: int,
    lora_alpha: float,
    target_modules: list[str],
    use_rslora: bool,
) -> dict:
    """adapter_config.json for a plain LoRA: the keys PEFT writes, with PEFT's defaults."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "corda_config": None,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": lora_alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": target_modules,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }


FLEET_FILES = (
    4  # a fleet's adapter folders share this many weight files (symlinks) to bound disk use
)


def write_fleet(root: Path, spec: ModelSpec, names: list[str], rank: int) -> dict[str, str]:
    """Write adapter folders `root / name` for `spec`'s model (rank `rank`, all seven projections,
    bfloat16, entries N(0, 0.01), alpha 2 x rank); return name -> folder. The folders share
    `FLEET_FILES` weight files, seeded by their index, through symlinks."""
    import torch
    from safetensors.torch import save_file

    files = []
    for k in range(min(FLEET_FILES, len(names))):
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(spec.num_layers):
            for module in LORA_MODULES:
                d_in, d_out = spec.lora_dims(module)
                key = _module_prefix(layer, module)
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, d_in, generator=g) * 0.01
                ).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(d_out, rank, generator=g) * 0.01
                ).bfloat16()
        path = root / f"weights-{k}.safetensors"
        save_file(tensors, str(path))
        files.append(path)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LORA_MODULES),
        "bias": "none",
    }
    out = {}
    for i, name in enumerate(names):
        folder = root / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(config))
        os.symlink(files[i % len(files)], folder / "adapter_model.safetensors")
        out[name] = str(folder)
    return out


def _module_prefix(layer: int, module: str) -> str:
    """PEFT's key of one projection's LoRA weights, before `.lora_{A,B}.weight`."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}"
