"""Hub -> disk: the tier above disk. Downloads of hub adapters into this node's cache, on threads
of their own, so a slow hub never takes a disk read's turn, a step, or the event loop.

One download per hub reference (`HubRef`, pinned to a commit), however many adapter versions or
requests need it. The engine thread starts downloads and collects them between steps
(`collect`); a finished one gives the folder the reader then reads like any other. A failed one
is remembered for `retry_after_s`: the requests waiting on it, and those that come meanwhile,
fail with its status (503 for a hub that cannot be reached) instead of each starting another;
after that a request starts a new download. A download running longer than `timeout_s` fails
its waiting requests (503; again every `retry_after_s` while it runs) but goes on, and a later
request finds what it brought. Only the
engine thread calls into this object; the pool threads only download.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from replicas.adapters.hub import HubRef
from replicas.adapters.peft_config import AdapterError
from replicas.errors import ErrorKind

logger = logging.getLogger("ray.serve")

DOWNLOAD_THREADS = 2
RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class FetchFailure:
    message: str
    kind: ErrorKind
    until: float  # clock time after which a new download may start


@dataclass(frozen=True)
class _Download:
    future: Future[Path]
    started: float


class HubFetcher:
    def __init__(
        self,
        download: Callable[[HubRef], Path],
        *,
        timeout_s: float,
        retry_after_s: float = RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        threads: int = DOWNLOAD_THREADS,
    ) -> None:
        self._download = download  # runs on a pool thread; raises AdapterError
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="lora-download")
        self._running: dict[HubRef, _Download] = {}
        self._folders: dict[HubRef, Path] = {}
        self._failures: dict[HubRef, FetchFailure] = {}
        self.downloads = 0  # downloads finished (from the hub, or found whole in the cache)

    def folder(self, ref: HubRef) -> Path | None:
        """The folder holding the adapter's files, once downloaded."""
        return self._folders.get(ref)

    def downloading(self, ref: HubRef) -> bool:
        return ref in self._running

    def failure(self, ref: HubRef) -> FetchFailure | None:
        """Why the last download of `ref` failed, while that still stands (`retry_after_s`)."""
        failure = self._failures.get(ref)
        if failure is not None and self.clock() >= failure.until:
            del self._failures[ref]
            return None
        return failure

    def start(self, ref: HubRef) -> None:
        """Start downloading `ref` unless it is downloaded or being downloaded."""
        if ref in self._folders or ref in self._running:
            return
        self._running[ref] = _Download(self._pool.submit(self._download, ref), self.clock())

    def finished(self) -> bool:
        """A download ended and was not collected yet (a look at the futures; never waits)."""
        return any(d.future.done() for d in self._running.values())

    def collect(self) -> None:
        """Take in finished downloads (folders, or failures), and fail the waits on downloads
        that ran past `timeout_s` (again every `retry_after_s` while they go on)."""
        now = self.clock()
        for ref, download in list(self._running.items()):
            if download.future.done():
                del self._running[ref]
                try:
                    self._folders[ref] = download.future.result()
                except AdapterError as e:
                    self._fail(ref, str(e), e.kind, now)
                except Exception as e:  # a bug, not the hub: still no 500 for the request
                    logger.exception("downloading %s failed", ref)
                    self._fail(
                        ref,
                        f"could not download {ref}: {type(e).__name__}",
                        ErrorKind.UNAVAILABLE,
                        now,
                    )
                else:
                    self.downloads += 1
                    self._failures.pop(ref, None)
            elif now - download.started > self.timeout_s and self.failure(ref) is None:
                message = (
                    f"the hub did not deliver {ref} within {self.timeout_s:g} s; the download "
                    "goes on, retry later"
                )
                self._fail(ref, message, ErrorKind.UNAVAILABLE, now)

    def forget(self, ref: HubRef) -> None:
        """Drop what is known of `ref` (its folder, a failure); a download running goes on."""
        self._folders.pop(ref, None)
        self._failures.pop(ref, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fail(self, ref: HubRef, message: str, kind: ErrorKind, now: float) -> None:
        self._failures[ref] = FetchFailure(message, kind, now + self.retry_after_s)
