"""Reading PEFT LoRA adapters from disk, validated against the base model.

Two levels: `read_adapter_config` is cheap (the folder and its JSON; the ingress uses it to reject a
bad adapter before any request is queued) and `load_adapter` reads and checks every tensor.
Pickle weights (`adapter_model.bin`) are refused: loading them can run arbitrary code.
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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in an `AdapterFile`'s bytes."""

    dtype: torch.dtype | None  # None: not a floating-point type
    shape: tuple[int, ...]
    start: int  # byte offsets into the whole file
    end: int


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
            raise FileTooLarge(f"{size} bytes, above the {max_bytes} any LoRA adapter of this "
                               "model within max_lora_rank can take; does it hold other "
                               "weights, such as embeddings?")
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


def _read_safetensors(
    path: Path, max_bytes: int
) -> tuple[torch.Tensor, dict[str, TensorEntry]]:
    """The file's bytes and its tensor table; ValueError or OSError if it is not safetensors
    or larger than `max_bytes`."""
    data = _read_bytes(path, max_bytes)
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the header size field")
    header_len = int.from_bytes(data[:8].tobytes(), "little")
    if header_len == 0 or 8 + header_len > len(data):
        raise ValueError(f"header of {header_len} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + header_len].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base, size = 8 + header_len, len(data)
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(n) for n in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor {key!r} has a malformed entry") from e
        dtype = _DTYPES.get(dtype_name)  # None: not floating point, refused by the caller
        if not 0 <= begin <= end <= size - base:
            raise ValueError(f"tensor {key!r} lies outside the file (truncated?)")
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: {end - begin} bytes for shape {list(shape)}")
        entries[key] = TensorEntry(dtype, shape, base + begin, base + end)
    return torch.from_numpy(data), entries


def read_adapter_file(
    name: str, path: str | Path, spec: ModelSpec, max_lora_rank: int
) -> AdapterFile:
    """Read an adapter's weights and check every tensor's name, shape, dtype and rank."""
    config = read_adapter_config(path, max_lora_rank)
    try:
        raw, entries = _read_safetensors(config.path / WEIGHTS_FILE,
                                         max_file_bytes(spec, max_lora_rank))
    except FileTooLarge as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is too large ({e})") from e
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({e})") from e
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for key, entry in entries.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in LORA_TARGETS:
            raise AdapterError(f"adapter {name!r}: unsupported tensor {key!r}")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} beyond the model's {spec.num_layers}"
            )
        found.setdefault((layer, target), {})[which] = entry
    if not found:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs, ratios = {}, {}
    for (layer, target), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        d_in, d_out = spec.lora_dims(target)
        r = a.shape[0] if a.shape else 0
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {target} has A {list(a.shape)} and "
                f"B {list(b.shape)}; the model needs A [r, {d_in}] and B [{d_out}, r]"
            )
        if r > max_lora_rank:
            raise AdapterError(f"adapter {name!r}: rank {r} above max_lora_rank {max_lora_rank}")
        if a.dtype is None or b.dtype is None:
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} is not floating point")
        parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        module = f"model.layers.{layer}.{parent}.{target}"
        ratio = config.scaling(r, config.alpha_for(module)) / config.scaling()
        if ratio != 1.0:
            ratios[(layer, target)] = ratio
        pairs[(layer, target)] = (a, b)
    return AdapterFile(name, config, raw, pairs, ratios)


def load_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> AdapterWeights:
    return read_adapter_file(name, path, spec, max_lora_rank).to_weights(dtype)
