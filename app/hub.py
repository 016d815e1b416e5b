"""Which hub adapters the app serves, and pinning them: the ingress's side of hub adapters
(the engine's, downloads and reads, is `replicas/adapters/hub.py` and `fetcher.py`).

Three ways a hub adapter comes in, each pinned to one commit before any engine replica hears of
it, so every replica serves the same weights:

- configured, `adapters: {sql: org/sql-lora}` (or `hf://org/sql-lora@v2`): pinned and checked
  when the app is built (`pin_configured_adapters`);
- loaded, `/v1/load_lora_adapter` with `lora_path: "hf://org/sql-lora[@rev]"`;
- named by a request, `"model": "org/sql-lora"` (or `org/sql-lora@rev`): served under that
  name on first use, as an `adapter_root` folder is.

The last two fetch from the hub at run time, so they are gated like run-time folders: only
repos matching `hub_adapter_repos` (glob patterns over repo ids, `myorg/*`); none by default.
Pinning and the checks (`HubAdapters.inspect`) run on a worker thread, bounded by
`hub_timeout_s` (then 503), and concurrent callers for one reference share one look-up.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from replicas.adapters.hub import HUB_SCHEME, HubAccess, HubAdapter, HubError, HubRef, inspect
from replicas.errors import ErrorKind

logger = logging.getLogger("ray.serve")

HUB_OFF_MESSAGE = (
    "loading adapters from the hub is turned off on this server: an operator must list the "
    "repos it may fetch from in the app arg hub_adapter_repos"
)


class HubAdapters:
    """The hub, as the ingress uses it: which repos may be fetched at run time (`allowed`), and
    what a reference is (`inspect`: pinned and checked)."""

    def __init__(self, repos: Sequence[str], access: HubAccess, max_lora_rank: int) -> None:
        self.repos = tuple(repos)  # glob patterns over repo ids; empty: nothing at run time
        self.access = access
        self.max_lora_rank = max_lora_rank
        self._inspecting: dict[HubRef, asyncio.Future[HubAdapter]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.repos)

    def allowed(self, ref: HubRef) -> bool:
        return any(fnmatch.fnmatchcase(ref.repo_id, pattern) for pattern in self.repos)

    def requested(self, model: str) -> HubRef | None:
        """The hub adapter a request's `model` names (`org/name[@revision]`) when the app may
        fetch it; None otherwise (an unknown model, for the caller)."""
        if "/" not in model:
            return None
        try:
            ref = HubRef.parse(model)
        except ValueError:
            return None
        return ref if self.allowed(ref) else None

    async def inspect(self, ref: HubRef) -> HubAdapter:
        """`ref` pinned and checked (`replicas.adapters.hub.inspect`), on a worker thread;
        callers asking at once share one look-up. Raises HubError (404, 400; 503 when the hub
        does not answer within `hub_timeout_s`, the look-up left to finish)."""
        future = self._inspecting.get(ref)
        if future is None:
            future = asyncio.ensure_future(
                asyncio.to_thread(inspect, ref, self.access, self.max_lora_rank)
            )
            self._inspecting[ref] = future
            future.add_done_callback(lambda done: self._done(ref, done))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.access.timeout_s)
        except TimeoutError:
            raise HubError(
                f"the hub did not answer for {ref} within {self.access.timeout_s:g} s; retry later",
                ErrorKind.UNAVAILABLE,
            ) from None

    def _done(self, ref: HubRef, future: asyncio.Future[HubAdapter]) -> None:
        self._inspecting.pop(ref, None)
        if not future.cancelled():
            future.exception()  # retrieved: a look-up nobody waited for any more is no error


def pin_configured_adapters(
    adapters: Mapping[str, str], max_lora_rank: int, access: HubAccess | None = None
) -> dict[str, str]:
    """The configured adapters with each hub id pinned and checked (`hf://org/name@<commit>`)
    and each folder made absolute (checked by the caller). A value is a hub id when it starts
    with `hf://`, or is `org/name[@revision]` and no such folder exists here. Raises ValueError
    naming every adapter that cannot be served. Blocks on the network."""
    access = access if access is not None else HubAccess.from_env()
    out, problems = {}, []
    for name, value in sorted(adapters.items()):
        ref = _hub_id(value)
        if ref is None:
            out[name] = str(Path(value).expanduser().absolute())
            continue
        try:
            out[name] = str(inspect(ref, access, max_lora_rank).ref)
        except HubError as e:
            problems.append(f"adapter {name!r} ({ref}): {e}")
    if problems:
        raise ValueError("invalid adapters in the app config:\n  " + "\n  ".join(problems))
    return out


def _hub_id(value: str) -> HubRef | None:
    if value.startswith(HUB_SCHEME):
        try:
            return HubRef.parse(value)
        except ValueError as e:
            raise ValueError(f"{value!r} is not a hub adapter reference: {e}") from e
    if value.startswith(("/", ".", "~")) or Path(value).expanduser().exists():
        return None
    try:
        return HubRef.parse(value)
    except ValueError:
        return None  # a relative folder that does not exist: the folder check says so
