"""Safetensors files: the header's tensor table, checked against the file, and the file's bytes.

`read_safetensors_header` reads the header alone (at most `MAX_HEADER_BYTES`, no tensor data);
`read_safetensors` reads the whole file, in ranges on the host threads. Both check every entry
the same way (`parse_safetensors_header`). numpy and the standard library only: no torch, so the
ingress can check a weights file without the engine's imports; the engine views the bytes as
tensors (`replicas/adapters/loader.py`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replicas.adapters.host_threads import HOST_THREADS, parallel

# Bytes per element of each safetensors dtype, so every entry's byte range is checked.
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
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # the only ones an adapter may hold

# The most header bytes read before giving up on a file: far above any LoRA adapter's (an
# 80-layer, all-projection adapter lists 1,120 tensors in about 200 KB), far below memory.
MAX_HEADER_BYTES = 16 << 20
READ_CHUNK = 8 << 20  # a file is read in ranges of at least this many bytes, in parallel


class SafetensorsError(ValueError):
    """A weights file that is not well-formed safetensors."""


class FileTooLarge(ValueError):
    """A file larger than the caller allows, refused before it is read."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"{size} bytes, above the limit of {max_bytes}")
        self.size = size
        self.max_bytes = max_bytes


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file's bytes."""

    dtype: str  # as the header spells it: "BF16", "F32", ...
    shape: tuple[int, ...]
    start: int  # byte offsets into the whole file
    end: int

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


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
        entries[key] = TensorEntry(dtype_name, tuple(shape), base + begin, base + end)
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


def read_safetensors(path: Path, max_bytes: int) -> tuple[np.ndarray, dict[str, TensorEntry]]:
    """The file's bytes (uint8) and its checked tensor table. Raises FileTooLarge, before
    reading, for a file larger than `max_bytes`; SafetensorsError or OSError if it is not
    safetensors."""
    data = _read_bytes(path, max_bytes)
    n = _header_length(data[:8].tobytes(), len(data))
    return data, parse_safetensors_header(data[8 : 8 + n].tobytes(), len(data))


def _read_bytes(path: Path, max_bytes: int) -> np.ndarray:
    """The whole file, read in ranges on the host threads (the GIL released in each read);
    FileTooLarge, before reading, if it is larger than `max_bytes`."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLarge(size, max_bytes)
        data = np.empty(size, dtype=np.uint8)
        step = max(READ_CHUNK, -(-size // HOST_THREADS))

        def read_range(start: int) -> None:
            view = data.data[start : start + step]
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], start + done)
                if got == 0:
                    raise OSError(f"the file ended at {start + done} of {size} bytes while read")
                done += got

        parallel(read_range, range(0, size, step))
    return data
