"""A few threads for the host-side work of reading an adapter.

Reading an adapter is memory-bound copying in numpy and torch calls that release the GIL: the
file's bytes out of the page cache, then the slot image packed from them (see
`LoraWeightPool.pack_file`). Split by file range and by layer over a few threads, that work runs
at the host's memory bandwidth instead of one core's (times in docs/perf/adapter_churn.md).

`parallel` is called from the adapter manager's read workers; its tasks never submit tasks of
their own, so the shared pool cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

HOST_THREADS = max(1, min(8, os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def parallel(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(x) for x in items], spread over the host threads; the first exception propagates."""
    items = list(items)
    if len(items) <= 1 or HOST_THREADS == 1:
        return [fn(x) for x in items]
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HOST_THREADS, thread_name_prefix="lora-host")
    return list(_pool.map(fn, items))
