"""Reading PEFT LoRA adapters from disk, validated against the base model.

Two levels: `read_adapter_config` is cheap (the folder and its JSON; the ingress uses it to reject a
bad adapter before any request is queued) and `load_adapter` reads and checks every tensor.
Pickle weights (`adapter_model.bin`) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from replicas.models.spec import LORA_TARGETS, ModelSpec

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served. `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterConfig:
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def scaling(self, rank: int | None = None, alpha: float | None = None) -> float:
        r = self.rank if rank is None else rank
        a = self.lora_alpha if alpha is None else alpha
        return a / math.sqrt(r) if self.use_rslora else a / r

    def alpha_for(self, module: str) -> float:
        for pattern, alpha in self.alpha_pattern.items():
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                return float(alpha)
        return self.lora_alpha


@dataclass(frozen=True)
class AdapterWeights:
    """Host tensors of one adapter. `modules[(layer, target)] = (A [r, in], B [out, r])`, with any
    per-module scaling that differs from `scaling` folded into B."""

    name: str
    rank: int  # the largest rank over its modules
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Set by `LoraWeightPool.pack`: one buffer per layer laid out as that pool's slot, so a
    # layer goes to the device in one copy. `modules` are then views into these buffers.
    layers: tuple[torch.Tensor, ...] | None = None

    @property
    def nbytes(self) -> int:
        if self.layers is not None:
            return sum(t.nbytes for t in self.layers)
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())

    def pinned(self) -> AdapterWeights:
        """The same weights in page-locked memory, so host->GPU copies can be asynchronous."""
        modules = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in self.modules.items()}
        return AdapterWeights(self.name, self.rank, self.scaling, modules)


def read_adapter_config(path: str | Path, max_lora_rank: int) -> AdapterConfig:
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter folder {str(root)!r} does not exist", status=404)
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"adapter folder {str(root)!r} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{config_path} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag in ("use_dora",):
        if cfg.get(flag):
            raise AdapterError(f"{config_path}: {flag} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: bias {cfg['bias']!r} is not supported (only none)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{config_path}: modules_to_save is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    rank_pattern = cfg.get("rank_pattern") or {}
    top_rank = max([rank, *rank_pattern.values()])
    if top_rank > max_lora_rank:
        raise AdapterError(
            f"adapter {root.name!r} has rank {top_rank}, above max_lora_rank {max_lora_rank}"
        )
    targets = cfg.get("target_modules") or []
    if targets == "all-linear":  # PEFT's shorthand for every linear layer but the LM head
        targets = list(LORA_TARGETS)
    elif isinstance(targets, str):  # a regex over module names
        pattern = targets
        targets = [
            t for t in LORA_TARGETS
            if any(re.fullmatch(pattern, f"model.layers.0.{parent}.{t}")
                   for parent in ("self_attn", "mlp"))
        ]
    if not targets:
        raise AdapterError(f"{config_path}: target_modules names none of {list(LORA_TARGETS)}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise AdapterError(
            f"adapter {root.name!r} targets {unknown}; supported targets: {list(LORA_TARGETS)}"
        )
    if not (root / WEIGHTS_FILE).is_file():
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            raise AdapterError(
                f"adapter {root.name!r} ships only pickle weights (.bin/.pt), which are refused "
                f"for safety; convert it to {WEIGHTS_FILE}"
            )
        raise AdapterError(f"adapter folder {str(root)!r} has no {WEIGHTS_FILE}")
    return AdapterConfig(
        path=root,
        rank=rank,
        lora_alpha=float(alpha),
        use_rslora=bool(cfg.get("use_rslora", False)),
        target_modules=tuple(targets),
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
    )


def load_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> AdapterWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(path, max_lora_rank)
    try:
        tensors = load_file(str(config.path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({e})") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in LORA_TARGETS:
            raise AdapterError(f"adapter {name!r}: unsupported tensor {key!r}")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} beyond the model's {spec.num_layers}"
            )
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        d_in, d_out = spec.lora_dims(target)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}; the model needs A [r, {d_in}] and B [{d_out}, r]"
            )
        if r > max_lora_rank:
            raise AdapterError(f"adapter {name!r}: rank {r} above max_lora_rank {max_lora_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} is not floating point")
        parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        module = f"model.layers.{layer}.{parent}.{target}"
        ratio = config.scaling(r, config.alpha_for(module)) / config.scaling()
        b = b.float() * ratio if ratio != 1.0 else b
        modules[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    rank = max(a.shape[0] for a, _ in modules.values())
    return AdapterWeights(name=name, rank=rank, scaling=config.scaling(), modules=modules)
