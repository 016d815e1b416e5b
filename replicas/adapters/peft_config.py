"""PEFT LoRA adapter configs: `adapter_config.json` read, checked and matched as PEFT matches it.

`read_adapter_config` checks a folder cheaply (the folder, its JSON, and which weights files sit
beside it: what the engine's `VersionRegistry` checks when a name is first used) and answers what
the config puts LoRA on (`AdapterConfig.applies_to`), at which rank and scaling; the weights file
is checked against it by replicas/adapters/layout.py. Plain Python: no torch, so the ingress
checks folders without the engine's imports. Pickle weights (`adapter_model.bin`) are refused:
loading them can run arbitrary code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from replicas.errors import ErrorKind, ServingError
from replicas.models.spec import LORA_TARGETS

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class AdapterError(ServingError, ValueError):
    """An adapter that cannot be served: `kind` INVALID (bad files) unless given."""


def peft_pattern_value(patterns: Mapping[str, float], module: str) -> float | None:
    """The value of the first key of a `rank_pattern` / `alpha_pattern` (in the config's order)
    that matches `module` (e.g. "model.layers.0.self_attn.q_proj") as PEFT matches them: the key
    is a regex for the end of the name, after a dot or from the start, taken whole (so
    "k_proj|up_proj" names both). None when no key matches."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return None


@dataclass(frozen=True)
class AdapterConfig:
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_regex: str | None = None  # target_modules given as one regex over module names
    target_names: tuple[str, ...] | None = None  # ... or as a list: names or their dotted tails
    layers_to_transform: tuple[int, ...] | None = None  # None: every layer
    exclude_modules: str | tuple[str, ...] | None = None  # a regex, or names matched as suffixes

    def scaling(self, rank: int | None = None, alpha: float | None = None) -> float:
        r = self.rank if rank is None else rank
        a = self.lora_alpha if alpha is None else alpha
        return a / math.sqrt(r) if self.use_rslora else a / r

    def alpha_for(self, module: str) -> float:
        alpha = peft_pattern_value(self.alpha_pattern, module)
        return self.lora_alpha if alpha is None else float(alpha)

    def module_rank(self, module: str) -> int:
        """The rank PEFT gives `module` (a full name, `model.layers.0.self_attn.q_proj`): its
        `rank_pattern` value, else `r`."""
        rank = peft_pattern_value(self.rank_pattern, module)
        return self.rank if rank is None else int(rank)

    def applies_to(self, layer: int, target: str) -> bool:
        """Whether the config puts LoRA on `target` of `layer`, as PEFT decides it: the
        `target_modules` regex over the module's full name, or the list of targets within
        `layers_to_transform`; never a module of `exclude_modules`."""
        module = module_name(layer, target)
        excluded = self.exclude_modules
        if isinstance(excluded, str):
            if re.fullmatch(excluded, module):
                return False
        elif excluded and any(module == x or module.endswith(f".{x}") for x in excluded):
            return False
        if self.target_regex is not None:
            return re.fullmatch(self.target_regex, module) is not None
        names = self.target_names if self.target_names is not None else self.target_modules
        if not any(module == n or module.endswith(f".{n}") for n in names):
            return False
        return self.layers_to_transform is None or layer in self.layers_to_transform


def module_name(layer: int, target: str) -> str:
    """The full name of a projection in a Llama-family model, as PEFT's patterns see it."""
    parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{parent}.{target}"


def read_adapter_config(
    path: str | Path, max_lora_rank: int, *, require_weights: bool = True
) -> AdapterConfig:
    """The folder's adapter_config.json, checked (AdapterError: 404 no such folder, 400 a config
    that cannot be served). `require_weights` also asks for adapter_model.safetensors beside it
    (pickle-only weights refused); off for a hub adapter whose config came before its weights."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter folder {str(root)!r} does not exist", ErrorKind.NOT_FOUND)
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
    for flag in ("use_dora", "lora_bias", "target_parameters", "trainable_token_indices"):
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
    target_regex = None
    if targets == "all-linear":  # PEFT's shorthand for every linear layer but the LM head
        targets = list(LORA_TARGETS)
    elif isinstance(targets, str):  # a regex over module names
        target_regex = targets
        try:
            re.compile(target_regex)
        except re.error as e:
            raise AdapterError(f"{config_path}: target_modules is not a valid regex: {e}") from e
        targets = [
            t
            for t in LORA_TARGETS
            if any(
                re.fullmatch(target_regex, f"model.layers.{layer}.{parent}.{t}")
                for parent in ("self_attn", "mlp")
                for layer in range(_REGEX_PROBE_LAYERS)
            )
        ]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{config_path}: target_modules must be a list of names or a regex")
    # A list entry names a module by its name's end, as PEFT matches it: "q_proj", or a dotted
    # tail up to the full name ("model.layers.0.self_attn.q_proj", as PEFT writes
    # "all-linear" with exclude_modules).
    target_names = None if target_regex is not None else tuple(targets)
    targets = list(dict.fromkeys(t.rsplit(".", 1)[-1] for t in targets))
    if not targets:
        raise AdapterError(f"{config_path}: target_modules names none of {list(LORA_TARGETS)}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise AdapterError(
            f"adapter {root.name!r} targets {unknown}; supported targets: {list(LORA_TARGETS)}"
        )
    if require_weights and not (root / WEIGHTS_FILE).is_file():
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
        target_regex=target_regex,
        target_names=target_names,
        layers_to_transform=_layer_list(cfg.get("layers_to_transform"), config_path),
        exclude_modules=_excluded(cfg.get("exclude_modules"), config_path),
    )


# A regex `target_modules` is probed on this many layers to learn which targets it names at all.
_REGEX_PROBE_LAYERS = 128


def _layer_list(value: object, config_path: Path) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
    ):
        raise AdapterError(
            f"{config_path}: layers_to_transform must be a layer index or a list of them, "
            f"got {value!r}"
        )
    return tuple(layers)


def _excluded(value: object, config_path: Path) -> str | tuple[str, ...] | None:
    if not value:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise AdapterError(f"{config_path}: exclude_modules must be a regex or a list of names")
