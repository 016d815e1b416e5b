"""Adapters on the Hugging Face Hub: naming them, pinning them to a commit, checking and
downloading them. Plain Python over `huggingface_hub` (imported when used); no Ray. Every call
here blocks on the network: run it off the event loop and off the engine's step.

An adapter on the hub is named `hf://<org>/<repo>` or `hf://<org>/<repo>@<revision>` (a branch,
a tag or a commit); `HubRef` holds one. Before any engine replica is told of a hub adapter, it is
pinned to the commit its revision names now and checked (`inspect`): the repo must hold
`adapter_config.json` (a servable config, as a local folder's) and `adapter_model.safetensors`
no larger than the size cap; pickle weights are refused. Engine replicas then download exactly
that commit (`download`), into the Hugging Face cache of their node, and read it as any folder
(`replicas/adapters/layout.py` checks the weights against the model). Only those two files are
ever fetched.

Access follows the Hugging Face environment of the process: `HF_ENDPOINT` (the hub's address),
`HF_TOKEN` (private and gated repos; read by `huggingface_hub` itself), `HF_HUB_CACHE` or
`HF_HOME` (the cache) and `HF_HUB_OFFLINE=1` (no network: only what the cache holds is served,
pinned by the cache's own refs).

Failures are `HubError`s (an `AdapterError`) of the kind a client should get: NOT_FOUND for
a repo or revision the hub does not have (or will not show this server: a private repo without
a token), INVALID for a repo that is not a servable adapter, UNAVAILABLE for a hub that cannot
be reached or fails. Their messages name the hub reference, never a path of the cache; the
library's own error goes to the log. A download that fails leaves nothing a later one would
trust: `huggingface_hub` writes into `*.incomplete` files and links a file into the commit's
folder only once it is whole.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from replicas.adapters.peft_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    read_adapter_config,
)
from replicas.errors import ErrorKind

logger = logging.getLogger("ray.serve")

HUB_SCHEME = "hf://"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_BYTES = 2 << 30
# The hub's own rules for a repo id's parts: letters, digits, '.', '_', '-'; no '--' or '..'.
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_REVISION_CHARS = 255


@dataclass(frozen=True)
class HubRef:
    """An adapter on the hub: `repo_id` ("org/name") at `revision` (None: the default branch).
    Pinned when the revision is a commit hash. `str()` gives `hf://org/name[@revision]`."""

    repo_id: str
    revision: str | None = None

    def __post_init__(self) -> None:
        parts = self.repo_id.split("/")
        if len(parts) != 2 or not all(
            _REPO_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts
        ):
            raise ValueError(
                f"{self.repo_id!r} is not a hub repo id (org/name: letters, digits, '.', '_', '-')"
            )
        if self.revision is not None and (
            not self.revision
            or len(self.revision) > MAX_REVISION_CHARS
            or any(c.isspace() or not c.isprintable() for c in self.revision)
        ):
            raise ValueError(f"{self.revision!r} is not a hub revision")

    @classmethod
    def parse(cls, text: str) -> HubRef:
        """`hf://org/name[@revision]` or `org/name[@revision]`. Raises ValueError."""
        body = text.removeprefix(HUB_SCHEME)
        repo_id, at, revision = body.partition("@")
        return cls(repo_id, revision if at else None)

    @property
    def pinned(self) -> bool:
        return self.revision is not None and _COMMIT.fullmatch(self.revision) is not None

    def at(self, commit: str) -> HubRef:
        return HubRef(self.repo_id, commit)

    @property
    def id(self) -> str:
        """`org/name[@revision]`: the name a request may give it."""
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    def __str__(self) -> str:
        return HUB_SCHEME + self.id


Location = Path | HubRef  # where an adapter's files are: a folder, or a hub reference


def location_of(text: str | Location) -> Location:
    """A `hf://` string as a `HubRef` (ValueError if malformed), anything else as a folder."""
    if isinstance(text, HubRef):
        return text
    if isinstance(text, str) and text.startswith(HUB_SCHEME):
        return HubRef.parse(text)
    return Path(text)


class HubError(AdapterError):
    """A hub adapter that cannot be served now: NOT_FOUND, INVALID or UNAVAILABLE."""


@dataclass(frozen=True)
class HubAccess:
    """How this process reaches the hub. `endpoint` and `cache_dir` None: `huggingface_hub`'s
    own (HF_ENDPOINT, HF_HUB_CACHE / HF_HOME). `timeout_s` bounds each metadata call and each
    wait of a request on the hub; `max_bytes` caps an adapter's weights file."""

    endpoint: str | None = None
    cache_dir: str | None = None
    offline: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def from_env(
        cls, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> HubAccess:
        """This process's Hugging Face environment, read now (not when the library was
        imported)."""
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
        return cls(
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            offline=offline,
            timeout_s=timeout_s,
            max_bytes=max_bytes,
        )


@dataclass(frozen=True)
class HubAdapter:
    """A hub adapter pinned and checked: `ref` names its commit; `config` is its checked
    adapter_config.json (its `path` is the cache's folder: for the server, not for clients)."""

    ref: HubRef
    config: AdapterConfig
    size_bytes: int | None  # its weights file, from the hub's listing (or the cache)

    @property
    def rank(self) -> int:
        return max([self.config.rank, *self.config.rank_pattern.values()])


def inspect(ref: HubRef, access: HubAccess, max_lora_rank: int) -> HubAdapter:
    """Pin `ref` to the commit its revision names now and check it is a servable adapter: its
    file list (config, safetensors weights within `access.max_bytes`, no pickle-only weights)
    and its config (downloaded; the weights are not). Offline, the cache's own refs pin it and
    both files must be cached. Raises HubError."""
    try:
        if access.offline:
            config_file = Path(_download(ref, CONFIG_FILE, access))
            pinned = ref.at(config_file.parent.name)  # .../snapshots/<commit>/adapter_config.json
            size: int | None = _cached_size(pinned, access)
        else:
            pinned, files = _listing(ref, access)
            size = _check_files(pinned, files, access.max_bytes)
            # By the revision asked for, so the cache records where it points (an offline
            # server pins by that record); a branch that moved since the listing is listed again.
            config_file = Path(_download(ref, CONFIG_FILE, access))
            if config_file.parent.name != pinned.revision:
                pinned, files = _listing(ref.at(config_file.parent.name), access)
                size = _check_files(pinned, files, access.max_bytes)
    except HubError:
        raise
    except Exception as e:
        raise hub_error(e, ref, access) from e
    config = read_config(pinned, config_file.parent, max_lora_rank, require_weights=False)
    return HubAdapter(pinned, config, size)


def download(ref: HubRef, access: HubAccess) -> Path:
    """Download a pinned adapter's config and weights into the cache (or find them there) and
    return the folder holding both. Raises HubError."""
    if not ref.pinned:
        raise HubError(f"{ref} is not pinned to a commit")
    try:
        _download(ref, CONFIG_FILE, access)
        weights = Path(_download(ref, WEIGHTS_FILE, access))
    except Exception as e:
        raise hub_error(e, ref, access) from e
    return weights.parent


def read_config(
    ref: HubRef, folder: Path, max_lora_rank: int, *, require_weights: bool = True
) -> AdapterConfig:
    """`read_adapter_config` of a hub adapter's cached folder, its messages naming the
    hub reference instead of the folder. Raises HubError (400)."""
    try:
        return read_adapter_config(folder, max_lora_rank, require_weights=require_weights)
    except AdapterError as e:
        raise HubError(scrub(str(e), folder, ref)) from e


def scrub(message: str, folder: Path, ref: HubRef) -> str:
    """`message` with the cache folder of `ref` (and its files) named by the hub reference."""
    return message.replace(str(folder), str(ref)).replace(repr(folder.name), repr(str(ref)))


def hub_error(error: BaseException, ref: HubRef, access: HubAccess) -> HubError:
    """The client's answer for a failure of `huggingface_hub` on `ref`; the library's message
    (URLs, cache paths) goes to the log only."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    logger.warning("hub adapter %s: %r", ref, error)
    if isinstance(error, RevisionNotFoundError):
        return HubError(
            f"the hub has no revision {ref.revision!r} of {ref.repo_id}", ErrorKind.NOT_FOUND
        )
    if isinstance(error, RepositoryNotFoundError):
        return HubError(
            f"the hub has no repo {ref.repo_id} that this server may read (a private or gated "
            "repo needs HF_TOKEN set on every node)",
            ErrorKind.NOT_FOUND,
        )
    if isinstance(error, RemoteEntryNotFoundError):
        return HubError(f"{ref} is not a PEFT LoRA adapter: a file it needs is missing")
    if isinstance(error, LocalEntryNotFoundError | OfflineModeIsEnabled) and access.offline:
        return HubError(
            f"{ref} is not in this server's hub cache, and the hub is offline (HF_HUB_OFFLINE)",
            ErrorKind.NOT_FOUND,
        )
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            return HubError(
                f"the hub refuses this server access to {ref.repo_id}", ErrorKind.NOT_FOUND
            )
    return HubError(f"the hub did not deliver {ref}; retry later", ErrorKind.UNAVAILABLE)


# -- internals ----------------------------------------------------------------------------------


def _listing(ref: HubRef, access: HubAccess) -> tuple[HubRef, dict[str, int | None]]:
    """The commit `ref`'s revision names now, and its files with their sizes."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=access.endpoint).model_info(
        ref.repo_id, revision=ref.revision, files_metadata=True, timeout=access.timeout_s
    )
    if not info.sha or not _COMMIT.fullmatch(info.sha):
        raise HubError(f"the hub named no commit for {ref}; retry later", ErrorKind.UNAVAILABLE)
    return ref.at(info.sha), {s.rfilename: s.size for s in info.siblings or ()}


def _check_files(ref: HubRef, files: dict[str, int | None], max_bytes: int) -> int | None:
    """The weights file's size, once the listing shows a servable adapter. Raises HubError."""
    if CONFIG_FILE not in files:
        raise HubError(f"{ref} is not a PEFT LoRA adapter: it has no {CONFIG_FILE}")
    if WEIGHTS_FILE not in files:
        if any(name.endswith(PICKLE_SUFFIXES) for name in files):
            raise HubError(
                f"{ref} ships only pickle weights (.bin/.pt), which are refused for safety; it "
                f"needs {WEIGHTS_FILE}"
            )
        raise HubError(f"{ref} has no {WEIGHTS_FILE}")
    size = files[WEIGHTS_FILE]
    if size is not None and size > max_bytes:
        raise HubError(
            f"{ref}: {WEIGHTS_FILE} is {size} bytes, above this server's cap of {max_bytes} "
            "(the app arg max_hub_adapter_gib)"
        )
    return size


def _download(ref: HubRef, filename: str, access: HubAccess) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(
        ref.repo_id,
        filename,
        revision=ref.revision,
        cache_dir=access.cache_dir,
        endpoint=access.endpoint,
        local_files_only=access.offline,
        etag_timeout=access.timeout_s,
    )


def _cached_size(ref: HubRef, access: HubAccess) -> int:
    """The cached weights file's size (offline); HubError 404 when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(
        ref.repo_id, WEIGHTS_FILE, cache_dir=access.cache_dir, revision=ref.revision
    )
    if not isinstance(path, str):
        raise HubError(
            f"{ref} is not in this server's hub cache, and the hub is offline (HF_HUB_OFFLINE)",
            ErrorKind.NOT_FOUND,
        )
    size = os.path.getsize(path)
    if size > access.max_bytes:
        raise HubError(
            f"{ref}: {WEIGHTS_FILE} is {size} bytes, above this server's cap of "
            f"{access.max_bytes} (the app arg max_hub_adapter_gib)"
        )
    return size
