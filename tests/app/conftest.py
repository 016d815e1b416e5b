"""Fakes and fixtures for the app's tests: a scripted engine with a fleet of fake replicas, a
recording metrics backend, the byte tokenizer, adapter folders.

The byte tokenizer maps each UTF-8 byte to its own id, so a test scripts the engine's output as
`list("text".encode())` and knows exactly which text each token completes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from app.adapters import FleetView
from app.api import ApiSettings, make_api
from app.fleet import ReplicaReply
from app.metrics import IngressMetrics
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind
from replicas.protocol import EngineError, GenerateChunk, GenerateRequest
from synthetic.adapters import write_peft_adapter
from synthetic.tokenizer import build_byte_tokenizer

BASE = "tiny-base"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 259

# What Ray says of a dead replica: it names the actor, its class, process and host.
ACTOR_DIED = (
    "The actor died unexpectedly before finishing this task. class_name: EngineDeployment "
    "actor_id: 5e1f0c3a9d1b2c pid: 4242 ip: 10.0.0.7"
)


@dataclass
class FakeReplica:
    """One engine replica's adapter bookkeeping, as `EngineDeployment` keeps it.

    `status` is what its `adapters()` reports (name -> tier, slot, rank, ...). `down`: every call
    to it fails (a dead replica); `slow`: its engine does not answer an adapter report in time;
    `reject_loads`: its engine refuses every load with this kind of error.
    """

    replica_id: str
    paths: dict[str, str] = field(default_factory=dict)
    unloaded: set[str] = field(default_factory=set)
    status: dict[str, dict] = field(default_factory=dict)
    load_ids: dict[str, str] = field(default_factory=dict)
    down: bool = False
    slow: bool = False
    reject_loads: ErrorKind | None = None

    def load(self, name: str, path: str, pinned: bool, load_id: str) -> None:
        if self.reject_loads is not None:
            raise RequestRejected(f"cannot read adapter {name!r}", self.reject_loads)
        if name in self.paths:
            raise RequestRejected(f"adapter {name!r} is already loaded; unload it first")
        self.paths[name] = path
        self.unloaded.discard(name)
        self.status[name] = _status("disk", pinned=pinned)
        self.load_ids[name] = load_id

    def unload(self, name: str, load_id: str | None) -> None:
        if load_id is not None and self.load_ids.get(name) != load_id:
            raise RequestRejected(
                f"adapter {name!r} was not loaded by load {load_id}", ErrorKind.NOT_FOUND
            )
        if name not in self.paths:
            raise RequestRejected(f"adapter {name!r} is not loaded", ErrorKind.NOT_FOUND)
        del self.paths[name]
        self.status.pop(name, None)
        self.load_ids.pop(name, None)
        self.unloaded.add(name)


def _status(tier: str, *, slot=None, rank=None, size_bytes=None, pinned=False) -> dict:
    return {
        "tier": tier,
        "slot": slot,
        "rank": rank,
        "size_bytes": size_bytes,
        "pinned": pinned,
        "unloading": False,
    }


class FakeEngine:
    """An `EngineClient` that streams scripted chunks of token ids and records what it saw.

    `chunks` are sent in order; the last one carries `finish_reason`. With `hang=True` the stream
    waits forever after the scripted chunks (a request still generating); `endless=True` repeats
    the last chunk forever. `aborted` holds the ids of requests whose stream was closed or
    cancelled before the final chunk.

    Its control plane is `replicas` (one by default): broadcasts reach each of them; a request
    for an adapter the first replica has unloaded gets the engine's 404.
    """

    def __init__(
        self,
        chunks: Sequence[Sequence[int]] = (),
        *,
        finish_reason: str = "length",
        error: EngineError | None = None,
        error_after: int | None = None,
        hang: bool = False,
        endless: bool = False,
    ) -> None:
        self.chunks = [list(c) for c in chunks] or [[]]
        self.finish_reason = finish_reason
        self.error = error
        self.error_after = error_after
        self.hang = hang
        self.endless = endless
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.info_calls = 0
        self.replicas = [FakeReplica("r0")]

    async def info(self) -> dict:
        self.info_calls += 1
        return {"max_model_len": MAX_MODEL_LEN, "eos_token_ids": [257], "vocab_size": VOCAB_SIZE}

    # -- control plane ---------------------------------------------------------------------

    async def served_adapters(self) -> FleetView:
        replica = next((r for r in self.replicas if not r.down), None)
        if replica is None:
            raise RuntimeError("no engine replica is running")
        return FleetView(dict(replica.paths), frozenset(replica.unloaded))

    async def broadcast_load_adapter(
        self, name: str, path: str, pinned: bool, load_id: str
    ) -> list[ReplicaReply]:
        return [_call(r, r.load, name, path, pinned, load_id) for r in self.replicas]

    async def broadcast_unload_adapter(
        self, name: str, load_id: str | None = None
    ) -> list[ReplicaReply]:
        return [_call(r, r.unload, name, load_id) for r in self.replicas]

    async def adapter_reports(self, timeout_s: float) -> list[ReplicaReply]:
        replies = []
        for r in self.replicas:
            if r.down:
                replies.append(ReplicaReply(error=RuntimeError(ACTOR_DIED)))
            elif r.slow:
                answer = {"replica_id": r.replica_id, "adapters": None, "error": "too slow"}
                replies.append(ReplicaReply(r.replica_id, answer))
            else:
                answer = {"replica_id": r.replica_id, "adapters": dict(r.status), "error": None}
                replies.append(ReplicaReply(r.replica_id, answer))
        return replies

    # -- generation --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        rid = request.request_id
        n_prompt = len(request.prompt_token_ids)
        if request.adapter in self.replicas[0].unloaded:
            message = f"the model {request.adapter!r} does not exist"
            yield GenerateChunk(
                rid, finish_reason="error", error=EngineError(message, ErrorKind.NOT_FOUND)
            )
            return
        if self.error is not None and self.error_after is None:
            yield GenerateChunk(rid, finish_reason="error", error=self.error)
            return
        final_sent = False
        try:
            for i, ids in enumerate(self.chunks):
                if self.error_after is not None and i == self.error_after:
                    final_sent = True
                    yield GenerateChunk(rid, finish_reason="error", error=self.error)
                    return
                last = i == len(self.chunks) - 1 and not (self.hang or self.endless)
                final_sent = last
                yield GenerateChunk(rid, ids, self.finish_reason if last else None, n_prompt)
                await asyncio.sleep(0)
            while self.endless:
                yield GenerateChunk(rid, self.chunks[-1], None, n_prompt)
                await asyncio.sleep(0)
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not final_sent:
                self.aborted.append(rid)


def _call(replica: FakeReplica, method, *args) -> ReplicaReply:
    if replica.down:
        return ReplicaReply(error=RuntimeError(ACTOR_DIED))
    try:
        return ReplicaReply(value=method(*args))
    except RequestRejected as e:
        return ReplicaReply(error=e)


class FakeMetricsBackend:
    """Stands in for `ray.serve.metrics`: each metric created records what it is given, by name
    in `metrics`. Like Ray's, a record must carry exactly the declared tag keys."""

    def __init__(self) -> None:
        self.metrics: dict[str, FakeMetric] = {}
        backend = self

        class _Metric(FakeMetric):
            def __init__(self, name, description="", boundaries=None, tag_keys=None):
                super().__init__(name, description, tuple(tag_keys or ()), boundaries)
                backend.metrics[name] = self

        self.Counter = self.Gauge = self.Histogram = _Metric

    def __getitem__(self, name: str) -> FakeMetric:
        return self.metrics[name]


class FakeMetric:
    def __init__(self, name, description, tag_keys, boundaries) -> None:
        assert name.startswith("lorafleet_") and description, name
        self.name = name
        self.tag_keys = tag_keys
        self.boundaries = boundaries
        self.records: list[tuple[float, dict[str, str]]] = []

    def _record(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        tags = dict(tags or {})
        assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
        self.records.append((value, tags))

    inc = observe = set = _record

    def values(self, **tags: str) -> list[float]:
        """The values recorded with (at least) these tags."""
        return [v for v, t in self.records if all(t.get(k) == x for k, x in tags.items())]

    def total(self, **tags: str) -> float:
        return sum(self.values(**tags))


def text_chunks(*pieces: str) -> list[list[int]]:
    """One engine chunk per piece, each the piece's UTF-8 bytes (= byte-tokenizer ids)."""
    return [list(p.encode()) for p in pieces]


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def lora_model_dir(tmp_path_factory) -> Path:
    """A config.json with LoRA-able shapes: enough for writing adapter folders."""
    model_dir = tmp_path_factory.mktemp("base")
    config = {
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def write_adapter(model_dir: Path, out: Path, *, rank: int = 4, **kwargs) -> Path:
    return write_peft_adapter(
        model_dir,
        out,
        rank=rank,
        lora_alpha=kwargs.pop("lora_alpha", 8.0),
        target_modules=kwargs.pop("target_modules", ("q_proj", "v_proj")),
        seed=kwargs.pop("seed", 0),
        **kwargs,
    )


@pytest.fixture
def adapter_root(tmp_path, lora_model_dir) -> Path:
    """Subfolders: `good` (rank 4), `too-big` (rank 64), `bin-only`, `bad-json`, `no-config`."""
    root = tmp_path / "adapters"
    write_adapter(lora_model_dir, root / "good")
    write_adapter(lora_model_dir, root / "too-big", rank=64)
    bin_only = write_adapter(lora_model_dir, root / "bin-only")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    bad_json = write_adapter(lora_model_dir, root / "bad-json")
    (bad_json / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    no_config = write_adapter(lora_model_dir, root / "no-config")
    (no_config / "adapter_config.json").unlink()
    return root


@pytest.fixture
def known_adapter(tmp_path, lora_model_dir) -> Path:
    return write_adapter(lora_model_dir, tmp_path / "sql-lora", rank=8)


def make_client(
    engine: FakeEngine,
    tokenizer,
    *,
    adapters: dict[str, str] | None = None,
    adapter_root: Path | None = None,
    metrics: IngressMetrics | None = None,
    runtime_adapter_dirs: tuple[str, ...] = ("/",),
    **settings_args,
) -> httpx.AsyncClient:
    """An HTTP client for one ingress replica over `engine`; several clients over the same engine
    are several ingress replicas of one app. Run-time loads may name any folder unless
    `runtime_adapter_dirs` says otherwise; `settings_args` are more `ApiSettings` fields."""
    settings = ApiSettings(
        served_model_name=BASE,
        model_root="/models/tiny-base",
        adapters=adapters or {},
        adapter_root=str(adapter_root) if adapter_root is not None else None,
        max_lora_rank=16,
        runtime_adapter_dirs=runtime_adapter_dirs,
        **settings_args,
    )
    metrics = metrics if metrics is not None else IngressMetrics(FakeMetricsBackend())
    api = make_api(engine, tokenizer, settings, metrics=metrics)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test")


def sse_events(body: str) -> list[dict | str]:
    """The `data:` payloads of an SSE body, JSON-decoded except for the final `[DONE]`."""
    assert body.endswith("\n\n"), body[-50:]
    events: list[dict | str] = []
    for block in body.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
