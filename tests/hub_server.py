"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that `huggingface_hub`
uses to pin and download a model repo's files, on 127.0.0.1, serving repos the tests build.

- `GET /api/models/<org>/<name>[/revision/<rev>]` (`HfApi.model_info`, with `?blobs=true` the
  file sizes): the commit the revision names and its files.
- `HEAD` and `GET /<org>/<name>/resolve/<rev>/<file>` (`hf_hub_download`): the commit in
  `X-Repo-Commit`, an `ETag` of the content, the bytes (with `Range`).

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), which
the client turns into its own exceptions. A private repo answers 401 RepoNotFound without
`Authorization: Bearer <token>`.

Faults, for the failure tests: `stall_downloads()` holds every file body after its first bytes
until `release()`; `drop_downloads(n)` cuts the next `n` file bodies half-way (the client
resumes with `Range`, so a drop on every attempt is needed to fail a download); `stall_api()`
holds API answers until `release()`. `requests` counts what was asked, by kind.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

STALL_AFTER_BYTES = 64
HANG_GUARD_S = 60.0  # a stalled answer is released after this long, whatever the test does


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    private_token: str | None = None


class FakeHub:
    """The server and its repos. `url` is what HF_ENDPOINT should be."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._released.set()
        self._stall_downloads = False
        self._stall_api = False
        self._drops = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    # -- repos --------------------------------------------------------------------------------

    def push(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        branch: str = "main",
        private_token: str | None = None,
    ) -> str:
        """A new commit of `files` (the whole tree) on `branch`; returns its sha."""
        sha = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo())
            repo.commits[sha] = dict(files)
            repo.refs[branch] = sha
            if private_token is not None:
                repo.private_token = private_token
        return sha

    def push_folder(self, repo_id: str, folder: str | Path, **kwargs) -> str:
        """A commit of every file in `folder` (not recursive)."""
        files = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
        return self.push(repo_id, files, **kwargs)

    # -- faults -------------------------------------------------------------------------------

    def stall_downloads(self) -> None:
        self._released.clear()
        self._stall_downloads = True

    def stall_api(self) -> None:
        self._released.clear()
        self._stall_api = True

    def drop_downloads(self, times: int) -> None:
        self._drops = times

    def release(self) -> None:
        self._stall_downloads = self._stall_api = False
        self._released.set()

    # -- answers ------------------------------------------------------------------------------

    def _commit(self, repo_id: str, revision: str, auth: str | None) -> tuple[str, dict] | int:
        """(sha, files), or the error: 401 (private, no token), 404 repo, 410 revision."""
        with self._lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                return 404
            if repo.private_token is not None and auth != f"Bearer {repo.private_token}":
                return 401
            sha = repo.refs.get(revision, revision)
            files = repo.commits.get(sha)
        return 410 if files is None else (sha, files)

    def _take_drop(self) -> bool:
        with self._lock:
            if self._drops > 0:
                self._drops -= 1
                return True
            return False


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            auth = self.headers.get("Authorization")
            if m := _API.fullmatch(path):
                hub.requests["api"] += 1
                if hub._stall_api:
                    hub._released.wait(HANG_GUARD_S)
                self._api(m.group(1), m.group(2) or "main", auth)
            elif m := _RESOLVE.fullmatch(path):
                hub.requests["head" if not body else "get"] += 1
                self._file(m.group(1), m.group(2), m.group(3), auth, body)
            else:
                self._error(404, "RepoNotFound")

        def _api(self, repo_id: str, revision: str, auth: str | None) -> None:
            found = hub._commit(repo_id, revision, auth)
            if isinstance(found, int):
                self._not_found(found)
                return
            sha, files = found
            siblings = [
                {"rfilename": name, "size": len(data), "blobId": _etag(data)}
                for name, data in sorted(files.items())
            ]
            self._send(200, json.dumps({"id": repo_id, "sha": sha, "siblings": siblings}).encode(),
                       {"Content-Type": "application/json"})  # fmt: skip

        def _file(self, repo_id: str, revision: str, name: str, auth: str | None, body: bool):
            found = hub._commit(repo_id, revision, auth)
            if isinstance(found, int):
                self._not_found(found)
                return
            sha, files = found
            if name not in files:
                self._error(404, "EntryNotFound")
                return
            data = files[name]
            headers = {"X-Repo-Commit": sha, "ETag": f'"{_etag(data)}"'}
            start = 0
            if body and (rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
                start = int(rng.group(1))
            part = data[start:]
            headers["Content-Length"] = str(len(part))
            self.send_response(206 if start else 200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not body:
                return
            if hub._stall_downloads and len(part) > STALL_AFTER_BYTES:
                self.wfile.write(part[:STALL_AFTER_BYTES])
                self.wfile.flush()
                hub._released.wait(HANG_GUARD_S)
                part = part[STALL_AFTER_BYTES:]
            if hub._take_drop():
                self.wfile.write(part[: len(part) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the body ends short: the client sees it cut
                return
            self.wfile.write(part)

        def _not_found(self, status: int) -> None:
            if status == 401:
                self._error(401, "RepoNotFound")
            elif status == 410:
                self._error(404, "RevisionNotFound")
            else:
                self._error(404, "RepoNotFound")

        def _error(self, status: int, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self._send(status, body, {"X-Error-Code": code, "Content-Type": "application/json"})

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
