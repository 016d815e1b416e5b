"""The asyncio front of the engine (replicas/async_engine.py): each step's outputs reach the
streams in one callback, and a stream's tokens are sent in fewer, larger chunks,
with the same tokens in the same order."""

from __future__ import annotations

import asyncio

import pytest

from replicas.async_engine import AsyncEngine
from replicas.protocol import GenerateRequest
from tests.replicas.conftest import greedy, make_engine

PROMPTS = [[5, 17, 200, 33], [61, 150, 7], [100, 2, 77, 13, 250], [8, 8, 8, 9]]
MAX_TOKENS = 24
HOLD_S = 0.2  # the coalescing interval while held


async def stream_all(engine: AsyncEngine) -> dict[str, list[tuple[float, list[int]]]]:
    """Every request's chunks, (when it came, its token ids) each, all streams open at once."""
    loop = asyncio.get_running_loop()

    async def one(i: int) -> list[tuple[float, list[int]]]:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [(loop.time(), chunk.token_ids) async for chunk in engine.generate(request)]

    results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return {f"r{i}": chunks for i, chunks in enumerate(results)}


@pytest.fixture
def engine(models):
    front = AsyncEngine(make_engine(models["llama"]))
    front.start()
    yield front
    front.shutdown()


async def test_chunks_are_coalesced_with_the_same_tokens(engine):
    engine.stream_interval_s = 0.0
    plain = await stream_all(engine)
    # Far above a CPU step (a few ms): the tokens of many steps come in while a chunk is held.
    engine.stream_interval_s = HOLD_S
    held = await stream_all(engine)
    for request_id, chunks in plain.items():
        tokens = [t for _, chunk in chunks for t in chunk]
        assert len(tokens) == MAX_TOKENS
        assert [t for _, chunk in held[request_id] for t in chunk] == tokens  # same, in order
        assert len(chunks[0][1]) == len(held[request_id][0][1]) == 1  # the first is never held
    for chunks in held.values():
        # Every chunk after the first but the last (which goes at once) waited out the interval
        # since the one before. The slack is what the reader may lag behind each send (the
        # same thread, without awaiting); unheld, the gaps are a step.
        times = [t for t, _ in chunks]
        gaps = [b - a for a, b in zip(times[:-2], times[1:-1], strict=True)]
        assert all(gap >= HOLD_S / 2 for gap in gaps), times
    # ...and held, a chunk carries several tokens: fewer chunks than tokens.
    assert sum(map(len, held.values())) < len(PROMPTS) * MAX_TOKENS
