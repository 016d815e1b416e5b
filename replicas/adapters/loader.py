"""Reading a PEFT LoRA adapter's weights into host tensors, checked against the base model.

`read_adapter_file` is the engine's read (on a reader thread): the whole weights file in one
read, every tensor checked as `check_adapter_files` checks a folder at load
(replicas/adapters/layout.py), nothing made per module (`AdapterFile`). `load_adapter` turns that
into per-module tensors (`AdapterWeights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from replicas.adapters.layout import Pairs, check_layout
from replicas.adapters.peft_config import (
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    module_name,
    read_adapter_config,
)
from replicas.adapters.safetensors_file import FileTooLarge, TensorEntry, read_safetensors
from replicas.models.spec import LORA_TARGETS, ModelSpec

# The torch dtype of each floating-point safetensors dtype (the only ones an adapter may hold).
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
HEADER_ALLOWANCE = 64 << 20  # room for a safetensors header in `max_file_bytes`


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
    pairs: Pairs  # (layer, target) -> (A, B)
    ratios: dict[tuple[int, str], float]  # per-module scaling over `config.scaling()`, if not 1

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of every tensor in the file; None when they differ."""
        names = {e.dtype for pair in self.pairs.values() for e in pair}
        return TORCH_DTYPES[names.pop()] if len(names) == 1 else None

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        dtype = TORCH_DTYPES[entry.dtype]
        data = self.raw[entry.start : entry.end]
        if entry.start % dtype.itemsize:  # safetensors does not promise aligned data
            data = data.clone()
        return data.view(dtype).view(entry.shape)

    def to_weights(self, dtype: torch.dtype) -> AdapterWeights:
        modules = {}
        for key, (a_entry, b_entry) in self.pairs.items():
            a, b = self.tensor(a_entry), self.tensor(b_entry)
            ratio = self.ratios.get(key, 1.0)
            b = b.float() * ratio if ratio != 1.0 else b
            modules[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        return AdapterWeights(self.name, self.rank, self.config.scaling(), modules)


def max_file_bytes(spec: ModelSpec, max_lora_rank: int) -> int:
    """The largest weights file a servable adapter of this model can have: every projection of
    every layer at `max_lora_rank` in float64, plus a generous header. Anything larger holds
    other weights, and is refused before it is read into memory."""
    per_layer = sum(max_lora_rank * sum(spec.lora_dims(target)) for target in LORA_TARGETS)
    return spec.num_layers * per_layer * 8 + HEADER_ALLOWANCE


def read_adapter_file(
    name: str, path: str | Path, spec: ModelSpec, max_lora_rank: int
) -> AdapterFile:
    """Read an adapter's weights, with every tensor checked as `check_adapter_files` does."""
    config = read_adapter_config(path, max_lora_rank)
    try:
        data, entries = read_safetensors(
            config.path / WEIGHTS_FILE, max_file_bytes(spec, max_lora_rank)
        )
    except FileTooLarge as e:
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} is too large ({e.size} bytes, above the "
            f"{e.max_bytes} any LoRA adapter of this model within max_lora_rank can take; "
            "does it hold other weights, such as embeddings?)"
        ) from e
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({e})") from e
    pairs = check_layout(name, config, entries, spec)
    ratios = {}
    for (layer, target), (a, _) in pairs.items():
        module = module_name(layer, target)
        ratio = config.scaling(a.shape[0], config.alpha_for(module)) / config.scaling()
        if ratio != 1.0:
            ratios[(layer, target)] = ratio
    return AdapterFile(name, config, torch.from_numpy(data), pairs, ratios)


def load_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> AdapterWeights:
    """Per-module host tensors in `dtype` (`AdapterFile.to_weights`); the engine packs
    `read_adapter_file`'s bytes instead."""
    return read_adapter_file(name, path, spec, max_lora_rank).to_weights(dtype)
