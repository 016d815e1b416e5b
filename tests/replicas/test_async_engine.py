"""The asyncio front of the engine (replicas/async_engine.py): each step's outputs reach the
streams in one callback, and under load a stream's tokens are sent in fewer, larger chunks,
with the same tokens in the same order."""

from __future__ import annotations

import asyncio

import pytest

from replicas import async_engine
from replicas.async_engine import AsyncEngine
from replicas.protocol import GenerateRequest
from tests.replicas.conftest import greedy, make_engine

PROMPTS = [[5, 17, 200, 33], [61, 150, 7], [100, 2, 77, 13, 250], [8, 8, 8, 9]]
MAX_TOKENS = 24


async def stream_all(engine: AsyncEngine) -> dict[str, list[list[int]]]:
    """Every request's chunks (token lists), all streams open at once."""

    async def one(i: int) -> list[list[int]]:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [chunk.token_ids async for chunk in engine.generate(request)]

    results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return {f"r{i}": chunks for i, chunks in enumerate(results)}


@pytest.fixture
def engine(models):
    front = AsyncEngine(make_engine(models["llama"]))
    front.start()
    yield front
    front.shutdown()


async def test_chunks_are_coalesced_under_load_with_the_same_tokens(engine, monkeypatch):
    monkeypatch.setattr(async_engine, "COALESCE_MAX_S", 0.0)
    plain = await stream_all(engine)
    monkeypatch.setattr(async_engine, "COALESCE_PER_STREAM_S", 0.02)
    monkeypatch.setattr(async_engine, "COALESCE_MAX_S", 0.08)
    held = await stream_all(engine)
    for request_id, chunks in plain.items():
        tokens = [t for chunk in chunks for t in chunk]
        assert len(tokens) == MAX_TOKENS
        assert [t for chunk in held[request_id] for t in chunk] == tokens  # same, in order
        assert len(chunks[0]) == len(held[request_id][0]) == 1  # the first token is never held
    # Held for up to 80 ms while CPU steps take a few: several tokens a chunk.
    assert sum(map(len, held.values())) * 2 <= sum(map(len, plain.values()))
