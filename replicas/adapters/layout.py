"""Which tensors a PEFT LoRA weights file must hold, checked against its config and the model.

`check_adapter_files` is what a load is refused for (400): `read_adapter_config`, then the weights
file's header (`read_safetensors_header`, no tensor data) and every tensor's layout
(`check_layout`). The ingress runs it without a model; the engine runs it with its model at load,
and `read_adapter_file` (replicas/adapters/loader.py) under the same checks when it reads.
Plain Python: no torch.

What the layout check enforces, tensor by tensor: a name of the form
`...layers.<i>.(self_attn|mlp).<target>.lora_(A|B)[.<adapter>].weight`; a floating-point dtype; a
target and layer the config applies LoRA to (`target_modules`, `layers_to_transform`,
`exclude_modules`, as PEFT matches them) and a layer the model has; A [r, in] and B [out, r] with
`r` the module's rank in the config (`rank_pattern`, else `r`) and in/out the model's. And the
other way round: every module the config applies to has both A and B. PEFT itself would load an
adapter with missing modules (it warns "Found missing adapter keys" and leaves them at their
initialisation, B = 0: no change), and would fail on a shape mismatch; a file that disagrees with
its config is a broken export, so both are refused here.
"""

from __future__ import annotations

import re
from pathlib import Path

from replicas.adapters.peft_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    module_name,
    read_adapter_config,
)
from replicas.adapters.safetensors_file import (
    SafetensorsError,
    TensorEntry,
    read_safetensors_header,
)
from replicas.models.spec import LORA_TARGETS, ModelSpec

_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)

Pairs = dict[tuple[int, str], tuple[TensorEntry, TensorEntry]]  # (layer, target) -> (A, B)


def check_layout(
    name: str, config: AdapterConfig, entries: dict[str, TensorEntry], spec: ModelSpec | None
) -> Pairs:
    """Match a weights file's tensors to the modules `config` puts LoRA on; raises AdapterError
    (400) naming the first tensor that does not fit (see the module docstring for the rules).
    Without `spec` (the ingress, which has no model), what needs the model is left out: the
    layer count, in/out sizes, and modules missing from layers the file has no tensor for."""
    found: dict[tuple[int, str], dict[str, tuple[str, TensorEntry]]] = {}
    for key, entry in entries.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in LORA_TARGETS:
            raise AdapterError(
                f"adapter {name!r}: unsupported tensor {key!r} (only lora_A/lora_B weights of "
                f"{', '.join(LORA_TARGETS)})"
            )
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if spec is not None and layer >= spec.num_layers:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is for layer {layer}; the model has "
                f"{spec.num_layers} (0..{spec.num_layers - 1})"
            )
        if not config.applies_to(layer, target):
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is for {module_name(layer, target)}, which "
                f"{CONFIG_FILE} does not target"
            )
        if not entry.is_float:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is {entry.dtype}, not floating point"
            )
        earlier = found.setdefault((layer, target), {}).get(which)
        if earlier is not None:
            raise AdapterError(
                f"adapter {name!r}: tensors {earlier[0]!r} and {key!r} are the same lora_{which}"
            )
        found[(layer, target)][which] = (key, entry)
    if not found:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    layers = range(spec.num_layers) if spec is not None else sorted({k[0] for k in found})
    missing = [
        f"{module_name(layer, target)}.lora_{which}"
        for layer in layers
        for target in LORA_TARGETS
        if config.applies_to(layer, target)
        for which in "AB"
        if which not in found.get((layer, target), {})
    ]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AdapterError(
            f"adapter {name!r}: {CONFIG_FILE} targets {missing[0].rsplit('.', 1)[0]}, but "
            f"{WEIGHTS_FILE} has no {missing[0].rsplit('.', 1)[1]} for it{more}"
        )
    pairs: Pairs = {}
    for (layer, target), ab in sorted(found.items()):
        r = config.module_rank(module_name(layer, target))
        d_in, d_out = spec.lora_dims(target) if spec is not None else (None, None)
        for which, want in (("A", (r, d_in)), ("B", (d_out, r))):
            key, entry = ab[which]
            if len(entry.shape) != 2 or any(
                w is not None and got != w for got, w in zip(entry.shape, want, strict=True)
            ):
                need = ", ".join("any" if w is None else str(w) for w in want)
                raise AdapterError(
                    f"adapter {name!r}: tensor {key!r} has shape {list(entry.shape)}; expected "
                    f"[{need}] (rank {r} in {CONFIG_FILE}"
                    + (", the model's sizes)" if spec is not None else ")")
                )
        pairs[(layer, target)] = (ab["A"][1], ab["B"][1])
    return pairs


def check_adapter_files(
    name: str, path: str | Path, max_lora_rank: int, spec: ModelSpec | None = None
) -> AdapterConfig:
    """`read_adapter_config`, then the weights file's header and every tensor's layout
    (`check_layout`), without reading any tensor data: what a load is refused for (400). Raises
    AdapterError."""
    config = read_adapter_config(path, max_lora_rank)
    try:
        entries = read_safetensors_header(config.path / WEIGHTS_FILE)
    except (OSError, SafetensorsError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({e})") from e
    check_layout(name, config, entries, spec)
    return config
