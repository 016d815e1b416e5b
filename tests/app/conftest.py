"""Fakes and fixtures for the app's tests: a scripted engine, the byte tokenizer, adapter folders.

The byte tokenizer maps each UTF-8 byte to its own id, so a test scripts the engine's output as
`list("text".encode())` and knows exactly which text each token completes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest

from app.demo import build_byte_tokenizer, write_peft_adapter
from app.ingress import ApiSettings, make_api
from replicas.protocol import EngineError, GenerateChunk, GenerateRequest

BASE = "tiny-base"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 259


class FakeEngine:
    """An `EngineClient` that streams scripted chunks of token ids and records what it saw.

    `chunks` are sent in order; the last one carries `finish_reason`. With `hang=True` the stream
    waits forever after the scripted chunks (a request still generating); `endless=True` repeats
    the last chunk forever. `aborted` holds the ids of requests whose stream was closed or
    cancelled before the final chunk.
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

    async def info(self) -> dict:
        self.info_calls += 1
        return {"max_model_len": MAX_MODEL_LEN, "eos_token_ids": [257], "vocab_size": VOCAB_SIZE}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        rid = request.request_id
        n_prompt = len(request.prompt_token_ids)
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
) -> httpx.AsyncClient:
    settings = ApiSettings(
        served_model_name=BASE,
        model_root="/models/tiny-base",
        adapters=adapters or {},
        adapter_root=str(adapter_root) if adapter_root is not None else None,
        max_lora_rank=16,
    )
    api = make_api(engine, tokenizer, settings)
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
