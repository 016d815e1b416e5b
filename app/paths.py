"""Which server folders a client may name: `lora_path` in `/v1/load_lora_adapter`.

Loading at run time is off unless `runtime_adapter_dirs` lists folders; then `lora_path` must
resolve (symlinks followed) to a readable folder inside one of them. Every other path (outside,
missing, unreadable, not a folder, too long, not a path at all) gets one and the same refusal, so
the answers reveal nothing about the server's file system.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

# Longer than any path a file system accepts (Linux PATH_MAX is 4096 bytes).
MAX_PATH_CHARS = 4096

LOADING_OFF_MESSAGE = (
    "loading adapters at run time is turned off on this server: an operator must list the "
    "folders it may load from in the app arg runtime_adapter_dirs"
)
REFUSED_MESSAGE = (
    "lora_path must name a readable adapter folder inside one of the folders this server "
    "loads adapters from (the app arg runtime_adapter_dirs)"
)


class PathRefused(ValueError):
    """`lora_path` is not a folder the server may load from. The message is the same whatever
    the reason."""

    def __init__(self) -> None:
        super().__init__(REFUSED_MESSAGE)


def resolve_runtime_adapter_path(lora_path: str, allowed_dirs: Sequence[str | Path]) -> Path:
    """The folder `lora_path` names, symlinks resolved, when it is a readable folder inside one
    of `allowed_dirs` (resolved too; a relative `lora_path` is taken from the working directory).
    Raises `PathRefused` otherwise. Touches the file system: call it off the event loop.

    The engine replicas are sent the resolved path, so a symlink changed after this check does
    not redirect them; a folder swapped inside an allowed folder still can (whoever may write
    there is trusted).
    """
    if not lora_path or len(lora_path) > MAX_PATH_CHARS or "\0" in lora_path:
        raise PathRefused()
    try:
        resolved = Path(lora_path).expanduser().absolute().resolve(strict=True)
        inside = any(resolved.is_relative_to(root) for root in _resolved_roots(allowed_dirs))
        usable = inside and resolved.is_dir() and os.access(resolved, os.R_OK | os.X_OK)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: "~user" with no such user
        raise PathRefused() from None
    if not usable:
        raise PathRefused()
    return resolved


def _resolved_roots(allowed_dirs: Sequence[str | Path]) -> list[Path]:
    roots = []
    for folder in allowed_dirs:
        try:
            roots.append(Path(folder).expanduser().resolve(strict=True))
        except (OSError, RuntimeError):
            continue  # a folder that does not exist (yet) allows nothing
    return roots
