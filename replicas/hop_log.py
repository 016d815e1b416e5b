"""Per-request hop times on the served path, for diagnosis: off unless `LORAFLEET_HOP_LOG`
names a folder in a process's environment (`app.main.replica_env` passes it to every replica).

`stamp(event, request_id)` then appends one line, `event request_id unix_time`, to that
folder's `hops-<pid>.log`. The request id is Serve's (the one its access logs print in the
proxy, the ingress and the engine replica alike), so one request's lines from every process
join up; `benchmarks/serve_hops.py` reads them beside the proxy's access log. Each line is
written at once (a process stopped by `serve.shutdown` writes no exit handler): a few
microseconds a stamp, for a diagnostic run only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

__all__ = ["ENV", "enabled", "serve_request_id", "stamp"]

ENV = "LORAFLEET_HOP_LOG"

_folder = os.environ.get(ENV) or None
_file: TextIO | None = None


def enabled() -> bool:
    return _folder is not None


def serve_request_id() -> str:
    """The id Serve gave the request being handled ("" outside a Serve request)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or ""
    except Exception:
        return ""


def stamp(event: str, request_id: str | None = None) -> None:
    """Note that `event` happened now to the request (Serve's current one by default)."""
    global _file
    if _folder is None:
        return
    if _file is None:
        Path(_folder).mkdir(parents=True, exist_ok=True)
        _file = open(Path(_folder) / f"hops-{os.getpid()}.log", "a", buffering=1)  # noqa: SIM115
    rid = request_id if request_id is not None else serve_request_id()
    _file.write(f"{event} {rid} {time.time():.6f}\n")
