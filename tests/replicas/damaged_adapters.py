"""Bad adapters made from good ones, one flaw each, for the load-time checks.

`damage(good, out, kind)` copies the PEFT folder `good` to `out` and breaks it as `kind` says.
`AT_INGRESS` lists the kinds the ingress refuses without the model (the file and its config
disagree); the others need the model's sizes and are refused by the engine replicas.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

AT_INGRESS = {
    "truncated": "truncated",
    "random_bytes": "header claims",
    "huge_header": "header claims 4611686018427387904 bytes",
    "rank_64_under_r_8": "rank 8 in adapter_config.json",
    "missing_target": "has no lora_",
    "untargeted_tensor": "does not target",
}
AT_ENGINE = {
    "wrong_shape_a": "expected [8, 64]",
    "missing_layer": "model.layers.1",
    "layer_beyond_model": "the model has 2",
}


def damage(good: Path, out: Path, kind: str) -> Path:
    """A copy of the adapter at `good` in `out`, broken as `kind` says (a key of `AT_INGRESS`
    or `AT_ENGINE`). Expects `good` to have r 8, two or more targets and the model's 2 layers
    with hidden size 64."""
    shutil.copytree(good, out)
    weights = out / WEIGHTS
    data = weights.read_bytes()
    if kind == "truncated":
        weights.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "random_bytes":
        rng = random.Random(0)
        weights.write_bytes(bytes(rng.getrandbits(8) for _ in range(len(data))))
    elif kind == "huge_header":
        weights.write_bytes((1 << 62).to_bytes(8, "little") + data[8:])
    else:
        tensors = load_file(weights)
        _edit(tensors, kind, out)
        save_file(tensors, weights, metadata={"format": "pt"})
    return out


def _edit(tensors: dict[str, torch.Tensor], kind: str, folder: Path) -> None:
    a_keys = sorted(k for k in tensors if ".lora_A." in k)
    if kind == "rank_64_under_r_8":
        for key in list(tensors):
            rows, cols = tensors[key].shape
            tensors[key] = torch.ones(64, cols) if ".lora_A." in key else torch.ones(rows, 64)
    elif kind == "missing_target":
        target = a_keys[0].split(".")[-3]  # ...self_attn.<target>.lora_A.weight
        for key in [k for k in tensors if f".{target}.lora_" in k]:
            del tensors[key]
    elif kind == "untargeted_tensor":
        config = json.loads((folder / CONFIG).read_text())
        targets = sorted(config["target_modules"])
        config["target_modules"] = targets[1:]  # the file still holds targets[0]'s weights
        (folder / CONFIG).write_text(json.dumps(config))
    elif kind == "wrong_shape_a":
        key = a_keys[0]
        r, d_in = tensors[key].shape
        tensors[key] = torch.zeros(r, d_in + 8)
    elif kind == "missing_layer":
        for key in [k for k in tensors if ".layers.1." in k]:
            del tensors[key]
    elif kind == "layer_beyond_model":
        for key in [k for k in tensors if ".layers.1." in k]:
            tensors[key.replace(".layers.1.", ".layers.2.")] = tensors[key].clone()
    else:
        raise ValueError(f"unknown damage {kind!r}")
