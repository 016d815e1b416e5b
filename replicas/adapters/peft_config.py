"""Reading PEFT LoRA adapters from disk, validated against the base model.

Three levels: `read_adapter_config` is cheap (the folder and its JSON; the ingress uses it to reject
a bad adapter before any request is queued); `check_adapter_files` adds the weights file's header
(at most `MAX_HEADER_BYTES`, no tensor data), every tensor's name, dtype, shape and byte range
checked against the config and, given one, the model -- what a load answers 400 with; and
`load_adapter` reads the tensors, under the same checks. Pickle weights (`adapter_model.bin`) are
refused: loading them can run arbitrary code.

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

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from replicas.adapters.host_threads import HOST_THREADS, parallel
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


def peft_pattern_value(patterns: dict[str, float], module: str) -> float | None:
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


@dataclass(frozen=True)
class AdapterWeights:
    """Host tensors of one adapter. `modules[(layer, target)] = (A [r, in], B [out, r])`, with any
    per-module scaling that differs from `scaling` folded into B."""

    name: str
    rank: int  # the largest rank over its modules
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Set by `LoraWeightPool.pack`: one uint8 buffer per layer holding the bytes of that pool's
    # slot, so a layer goes to the device in one copy. `modules` is then empty.
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


def read_adapter_config(
    path: str | Path, max_lora_rank: int, *, require_weights: bool = True
) -> AdapterConfig:
    """The folder's adapter_config.json, checked (AdapterError: 404 no such folder, 400 a config
    that cannot be served). `require_weights` also asks for adapter_model.safetensors beside it
    (pickle-only weights refused); off for a hub adapter whose config came before its weights."""
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


# safetensors dtypes: bytes per element of each (so every entry's byte range is checked), and
# the torch dtype of the floating-point ones (the only ones an adapter may hold).
_ITEMSIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# The most header bytes read before giving up on a file: far above any LoRA adapter's (an
# 80-layer, all-projection adapter lists 1,120 tensors in about 200 KB), far below memory.
MAX_HEADER_BYTES = 16 << 20


class SafetensorsError(ValueError):
    """A weights file that is not well-formed safetensors."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in an `AdapterFile`'s bytes."""

    dtype: torch.dtype | None  # None: not a floating-point type
    shape: tuple[int, ...]
    start: int  # byte offsets into the whole file
    end: int
    dtype_name: str = ""  # as the header spells it


@dataclass(frozen=True)
class AdapterFile:
    """An adapter's weights file, read with one call, and its layout checked against the model.

    Nothing here makes a tensor per module: a reader thread that ran one torch op per tensor would
    hand the GIL back and forth with the engine's step loop hundreds of times per adapter (each
    hand-back can wait out the interpreter's switch interval). `LoraWeightPool.pack_file` turns
    it into the packed layout (the slot's image) with three torch ops per layer; `to_weights`
    gives per-module tensors.
    """

    name: str
    config: AdapterConfig
    raw: torch.Tensor  # uint8, the whole file
    pairs: dict[tuple[int, str], tuple[TensorEntry, TensorEntry]]  # (layer, target) -> (A, B)
    ratios: dict[tuple[int, str], float]  # per-module scaling over `config.scaling()`, if not 1

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        data = self.raw[entry.start : entry.end]
        if entry.start % entry.dtype.itemsize:  # safetensors does not promise aligned data
            data = data.clone()
        return data.view(entry.dtype).view(entry.shape)

    def to_weights(self, dtype: torch.dtype) -> AdapterWeights:
        modules = {}
        for key, (a_entry, b_entry) in self.pairs.items():
            a, b = self.tensor(a_entry), self.tensor(b_entry)
            ratio = self.ratios.get(key, 1.0)
            b = b.float() * ratio if ratio != 1.0 else b
            modules[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        return AdapterWeights(self.name, self.rank, self.config.scaling(), modules)


READ_CHUNK = 8 << 20  # a file is read in ranges of at least this many bytes, in parallel
HEADER_ALLOWANCE = 64 << 20  # room for a safetensors header in `max_file_bytes`


class FileTooLarge(ValueError):
    pass


def max_file_bytes(spec: ModelSpec, max_lora_rank: int) -> int:
    """The largest weights file a servable adapter of this model can have: every projection of
    every layer at `max_lora_rank` in float64, plus a generous header. Anything larger holds
    other weights, and is refused before it is read into memory."""
    per_layer = sum(max_lora_rank * sum(spec.lora_dims(target)) for target in LORA_TARGETS)
    return spec.num_layers * per_layer * 8 + HEADER_ALLOWANCE


def _read_bytes(path: Path, max_bytes: int) -> np.ndarray:
    """The whole file, read in ranges on the host threads (the GIL released in each read);
    FileTooLarge, before reading, if it is larger than `max_bytes`."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLarge(
                f"{size} bytes, above the {max_bytes} any LoRA adapter of this "
                "model within max_lora_rank can take; does it hold other "
                "weights, such as embeddings?"
            )
        data = np.empty(size, dtype=np.uint8)
        step = max(READ_CHUNK, -(-size // HOST_THREADS))

        def read_range(start: int) -> None:
            view = memoryview(data)[start : start + step]
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], start + done)
                if got == 0:
                    raise OSError(f"the file ended at {start + done} of {size} bytes while read")
                done += got

        parallel(read_range, range(0, size, step))
    return data


def parse_safetensors_header(header: bytes, file_size: int) -> dict[str, TensorEntry]:
    """The tensor table of a safetensors file from its header (the JSON after the 8-byte
    length), every entry checked against the file's `file_size` bytes: a JSON object without
    repeated keys; each tensor a known dtype, a shape of non-negative integers and a byte range
    of exactly that shape's size; the ranges laid end to end from the start of the data to the
    end of the file, as safetensors writes them (no gap, no overlap, nothing after the last one;
    the safetensors library refuses such files too). Raises SafetensorsError."""
    base = 8 + len(header)
    try:
        table = json.loads(header, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"its header is not JSON: {e}") from e
    if not isinstance(table, dict):
        raise SafetensorsError("its header is not a JSON object")
    metadata = table.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("its __metadata__ is not an object of strings")
    entries = {}
    data_size = file_size - base
    for key, info in table.items():
        try:
            if set(info) != {"dtype", "shape", "data_offsets"}:
                raise ValueError
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not (
                isinstance(shape, list)
                and all(_is_count(n) for n in shape)
                and _is_count(begin)
                and _is_count(end)
                and isinstance(dtype_name, str)
            ):
                raise ValueError
        except (TypeError, ValueError):
            raise SafetensorsError(
                f"tensor {key!r} has a malformed entry (dtype, shape and data_offsets): {info!r}"
            ) from None
        if dtype_name not in _ITEMSIZES:
            raise SafetensorsError(f"tensor {key!r} has an unknown dtype {dtype_name!r}")
        want = math.prod(shape) * _ITEMSIZES[dtype_name]
        if end - begin != want:
            raise SafetensorsError(
                f"tensor {key!r}: data_offsets [{begin}, {end}) hold {end - begin} bytes, but "
                f"{dtype_name} {shape} takes {want}"
            )
        if end > data_size:
            raise SafetensorsError(
                f"tensor {key!r} needs bytes [{begin}, {end}) of the data, which has only "
                f"{data_size} (the file is truncated?)"
            )
        entries[key] = TensorEntry(
            _DTYPES.get(dtype_name), tuple(shape), base + begin, base + end, dtype_name
        )
    at = base
    for key, entry in sorted(entries.items(), key=lambda item: item[1].start):
        if entry.start != at:
            what = "overlaps the tensor before it" if entry.start < at else "leaves a gap"
            raise SafetensorsError(f"tensor {key!r} {what} (data_offsets out of order)")
        at = entry.end
    if at != file_size:
        raise SafetensorsError(f"{file_size - at} bytes follow the last tensor's data")
    return entries


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(k for k in keys if keys.count(k) > 1)
        raise SafetensorsError(f"its header names {repeated!r} twice")
    return dict(pairs)


def _is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _header_length(first8: bytes, file_size: int) -> int:
    if file_size < 8:
        raise SafetensorsError(f"{file_size} bytes, shorter than the header size field")
    n = int.from_bytes(first8, "little")
    if n == 0 or n > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"its header claims {n} bytes; a LoRA adapter's takes 1 to {MAX_HEADER_BYTES}"
        )
    if 8 + n > file_size:
        raise SafetensorsError(f"its header claims {n} bytes of a {file_size}-byte file")
    return n


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The checked tensor table of a safetensors file (`parse_safetensors_header`), reading
    only its header: nothing of the tensor data, at most `MAX_HEADER_BYTES`. Raises
    SafetensorsError or OSError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = _header_length(f.read(8), size)
        header = f.read(n)
    if len(header) != n:
        raise SafetensorsError("the file shrank while its header was read")
    return parse_safetensors_header(header, size)


def _read_safetensors(path: Path, max_bytes: int) -> tuple[torch.Tensor, dict[str, TensorEntry]]:
    """The file's bytes and its checked tensor table; SafetensorsError or OSError if it is not
    safetensors, FileTooLarge if larger than `max_bytes`."""
    data = _read_bytes(path, max_bytes)
    n = _header_length(data[:8].tobytes(), len(data))
    entries = parse_safetensors_header(data[8 : 8 + n].tobytes(), len(data))
    return torch.from_numpy(data), entries


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
        if entry.dtype is None:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is {entry.dtype_name}, not floating point"
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


def read_adapter_file(
    name: str, path: str | Path, spec: ModelSpec, max_lora_rank: int
) -> AdapterFile:
    """Read an adapter's weights, with every tensor checked as `check_adapter_files` does."""
    config = read_adapter_config(path, max_lora_rank)
    try:
        raw, entries = _read_safetensors(
            config.path / WEIGHTS_FILE, max_file_bytes(spec, max_lora_rank)
        )
    except FileTooLarge as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is too large ({e})") from e
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({e})") from e
    pairs = check_layout(name, config, entries, spec)
    ratios = {}
    for (layer, target), (a, _) in pairs.items():
        module = module_name(layer, target)
        ratio = config.scaling(a.shape[0], config.alpha_for(module)) / config.scaling()
        if ratio != 1.0:
            ratios[(layer, target)] = ratio
    return AdapterFile(name, config, raw, pairs, ratios)


def load_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> AdapterWeights:
    return read_adapter_file(name, path, spec, max_lora_rank).to_weights(dtype)
