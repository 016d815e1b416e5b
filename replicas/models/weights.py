"""Loading Hugging Face safetensors checkpoints into `LlamaModel`, fusing q/k/v and gate/up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps
from replicas.models.llama import DecoderLayer, LlamaModel
from replicas.models.spec import ModelSpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("*.bin")):
            raise ValueError(f"{model_dir} has only pickle (.bin) weights; convert to safetensors")
        raise FileNotFoundError(f"{model_dir} has no .safetensors weights")
    return files


def random_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    ops: LayerOps = TORCH_LAYER_OPS,
) -> LlamaModel:
    """A model of the right shapes with random weights: the same FLOPs and bytes as the real
    checkpoint, for benchmarks (load_format "dummy")."""
    with torch.device(device):
        model = LlamaModel(spec, max_positions, dtype, ops)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: LayerOps = TORCH_LAYER_OPS,
) -> LlamaModel:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    with torch.device(device):
        model = LlamaModel(spec, max_positions, dtype, ops)
    loaded: set[str] = set()
    with torch.no_grad():
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = _target(model, spec, name)
                    if target is None:
                        continue
                    param, rows = target
                    tensor = f.get_tensor(name)
                    dest = param if rows is None else param[rows]
                    if dest.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                            f"{tuple(dest.shape)}"
                        )
                    dest.copy_(tensor)
                    loaded.add(name)
    missing = [n for n in expected_names(spec) if n not in loaded]
    if missing:
        raise ValueError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    return model.eval()


def _target(model: LlamaModel, spec: ModelSpec, name: str):
    """(parameter, row slice or None) that checkpoint tensor `name` fills; None to skip it."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return (model.lm_head, None) if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None:
        return None  # rotary caches and other extras some checkpoints carry
    layer = model.layers[int(m.group(1))]
    assert isinstance(layer, DecoderLayer)  # LlamaModel.layers holds nothing else
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    rest = m.group(2)
    table = {
        "input_layernorm.weight": (layer.input_layernorm.weight, None),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, None),
        "self_attn.o_proj.weight": (layer.o_proj, None),
        "mlp.gate_proj.weight": (layer.gate_up_proj, slice(0, inter)),
        "mlp.up_proj.weight": (layer.gate_up_proj, slice(inter, 2 * inter)),
        "mlp.down_proj.weight": (layer.down_proj, None),
    }
    for p in "qkv":
        table[f"self_attn.{p}_proj.weight"] = (layer.qkv_proj, qkv_rows[p])
        if layer.qkv_bias is not None:
            table[f"self_attn.{p}_proj.bias"] = (layer.qkv_bias, qkv_rows[p])
    if spec.qk_norm:
        table["self_attn.q_norm.weight"] = (layer.q_norm.weight, None)
        table["self_attn.k_norm.weight"] = (layer.k_norm.weight, None)
    if rest not in table:
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
    return table[rest]


def expected_names(spec: ModelSpec) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if spec.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if spec.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(spec.num_layers):
        names += [f"model.layers.{i}.{n}" for n in per_layer]
    return names
