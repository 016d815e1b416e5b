"""The asyncio front of the engine (replicas/async_engine.py): each step's outputs reach the
streams in one callback, and a stream's tokens are sent in fewer, larger chunks,
with the same tokens in the same order; the same whether the engine runs on a thread of this
process or in a process of its own (`replicas.engine_core`)."""

from __future__ import annotations

import asyncio

import pytest

from replicas.async_engine import MAX_CHUNK_INTERVAL_S, AsyncEngine
from replicas.config import EngineConfig
from replicas.engine_core import build_core
from replicas.engine_loop import split_outputs
from replicas.errors import ErrorKind
from replicas.protocol import GenerateRequest
from replicas.request import RequestOutput
from tests.engines import GatedEngine
from tests.replicas.conftest import greedy

PROMPTS = [[5, 17, 200, 33], [61, 150, 7], [100, 2, 77, 13, 250], [8, 8, 8, 9]]
MAX_TOKENS = 24
HOLD_S = 0.2  # the coalescing interval while held


async def together(engine: AsyncEngine, streams) -> list:
    """Run the coroutines `streams` (one request each) to the end, their requests stepped in one
    batch from the first step: the same batches every run, so the same float rounding and the
    same greedy tokens, however the engine's loop (a process of its own runs in parallel with
    this one) and this loop's posts interleave."""
    await engine.call(GatedEngine.set_hold, "queued")
    tasks = [asyncio.ensure_future(stream) for stream in streams]
    await asyncio.sleep(0)  # each task runs up to its first wait: its request is posted
    # Calls run in the order posted, after the requests posted before them.
    assert await engine.call(GatedEngine.held_requests, "queued") == len(tasks)
    await engine.call(GatedEngine.set_hold, "open")
    return await asyncio.gather(*tasks)


async def stream_all(engine: AsyncEngine) -> dict[str, list[tuple[float, list[int]]]]:
    """Every request's chunks, (when it came, its token ids) each, all streams open at once."""
    loop = asyncio.get_running_loop()

    async def one(i: int) -> list[tuple[float, list[int]]]:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [(loop.time(), chunk.token_ids) async for chunk in engine.generate(request)]

    results = await together(engine, [one(i) for i in range(len(PROMPTS))])
    return {f"r{i}": chunks for i, chunks in enumerate(results)}


def engine_config(model_dir, **overrides) -> EngineConfig:
    args = {"model": str(model_dir), "num_kv_blocks": 128, "block_size": 4, "max_lora_rank": 16}
    return EngineConfig(**{**args, **overrides})


@pytest.fixture(scope="module", params=["thread", "process"])
def running(request, models):
    """One front per core for the module (an engine process takes seconds to start)."""
    config = engine_config(models["llama"], engine_process=request.param == "process")
    core, _ = build_core(config, GatedEngine)
    front = AsyncEngine(core)
    front.start()
    yield front
    front.shutdown()


@pytest.fixture
async def engine(running):
    """The module's front, with the pacing every test starts from."""
    running.stream_interval_s, running.max_chunks_per_s = 0.05, 0.0
    yield running
    assert running.alive
    for key in running.channel_keys():  # an idle channel ends without closing (its caller does)
        running.drop_channel(key)


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


def _assemble(chunks) -> list[int]:
    """A request's tokens from chunks that came by two ways, put in order by `start`."""
    tokens: list[int] = []
    for chunk in sorted(chunks, key=lambda c: (c.start, not c.token_ids)):
        assert chunk.start == len(tokens) or not chunk.token_ids, "a gap or an overlap"
        tokens += chunk.token_ids
    return tokens


async def _through_channel(engine: AsyncEngine, close_after_batches: int | None = None):
    """Every request with channel key "c" open; returns (request id -> chunks from its own
    stream, request id -> chunks from the channel, batches the channel sent). With
    `close_after_batches`, the channel is read that far and then closed while requests run."""
    channel = engine.open_channel("c")
    from_channel: dict[str, list] = {}
    batches: list[list] = []

    async def read() -> None:
        async for batch in channel.batches(idle_s=5.0):
            batches.append(batch)
            for chunk in batch:
                from_channel.setdefault(chunk.request_id, []).append(chunk)
            if close_after_batches is not None and len(batches) >= close_after_batches:
                await asyncio.sleep(engine.stream_interval_s / 2)  # more comes in meanwhile
                engine.close_channel(channel)

    async def one(i: int) -> list:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [chunk async for chunk in engine.generate(request, "c")]

    reader = asyncio.create_task(read())
    results = await together(engine, [one(i) for i in range(len(PROMPTS))])
    engine.close_channel(channel)
    await asyncio.wait_for(reader, 5.0)
    return {f"r{i}": chunks for i, chunks in enumerate(results)}, from_channel, batches


def test_the_chunk_interval_grows_with_the_flowing_streams_past_a_chunk_cap():
    front = AsyncEngine(None, stream_interval_s=0.05)  # type: ignore[arg-type]  # no core: pacing
    front.flowing = 400
    assert front.chunk_interval() == 0.05  # no cap
    front.max_chunks_per_s = 2000.0
    assert front.chunk_interval() == pytest.approx(0.2)  # 400 streams, 2,000 chunks a second
    front.flowing = 50
    assert front.chunk_interval() == 0.05  # within the cap at the floor
    front.flowing = 10**6
    assert front.chunk_interval() == MAX_CHUNK_INTERVAL_S


async def test_a_chunk_cap_holds_every_stream_longer_with_the_same_tokens(engine):
    engine.stream_interval_s = 0.0
    plain = await stream_all(engine)
    # Four streams at one chunk each per HOLD_S in all: the interval is HOLD_S, far above a step.
    engine.max_chunks_per_s = len(PROMPTS) / HOLD_S
    capped = await stream_all(engine)
    for request_id, chunks in plain.items():
        tokens = [t for _, chunk in chunks for t in chunk]
        assert [t for _, chunk in capped[request_id] for t in chunk] == tokens
        assert len(capped[request_id][0][1]) == 1  # the first still goes at once
        times = [t for t, _ in capped[request_id]]
        gaps = [b - a for a, b in zip(times[:-2], times[1:-1], strict=True)]
        assert all(gap >= HOLD_S / 2 for gap in gaps), times
    assert sum(map(len, capped.values())) < sum(map(len, plain.values())) / 2
    # A channel opened now paces by the same rule, read afresh for each batch.
    channel = engine.open_channel("caller")
    engine.flowing = 2 * len(PROMPTS)
    assert channel.interval_s() == engine.chunk_interval() == pytest.approx(2 * HOLD_S)
    engine.close_channel(channel)


async def test_a_channel_carries_every_request_between_its_first_and_last_chunks(engine):
    engine.stream_interval_s = 0.0
    plain = await stream_all(engine)
    engine.stream_interval_s = 0.05
    own, from_channel, batches = await _through_channel(engine)
    for request_id, chunks in plain.items():
        expected = [t for _, chunk in chunks for t in chunk]
        # Its own stream: the first token at once, and the last chunk; the rest on the channel.
        assert len(own[request_id]) == 2, own[request_id]
        assert len(own[request_id][0].token_ids) == 1 and own[request_id][-1].finished
        assert from_channel.get(request_id), "nothing went by the channel"
        assert _assemble(own[request_id] + from_channel[request_id]) == expected
    # A batch holds several requests' tokens: fewer items than chunks.
    assert max(len({c.request_id for c in batch}) for batch in batches) > 1


async def test_closing_a_channel_hands_what_it_holds_back_to_the_streams(engine):
    engine.stream_interval_s = 0.0
    plain = await stream_all(engine)
    engine.stream_interval_s = 0.05
    own, from_channel, batches = await _through_channel(engine, close_after_batches=1)
    assert len(batches) == 1
    assert not engine.channel_keys()
    for request_id, chunks in plain.items():
        expected = [t for _, chunk in chunks for t in chunk]
        got = own[request_id] + from_channel.get(request_id, [])
        assert _assemble(got) == expected  # nothing lost, nothing twice
    # The close came mid-way: most tokens between first and last came back on the streams.
    assert sum(len(c.token_ids) for c in batches[0]) < len(PROMPTS) * (MAX_TOKENS - 2) / 2


async def test_a_channel_with_nothing_to_send_ends_and_a_closed_one_ends_at_once(engine):
    channel = engine.open_channel("idle")
    assert [b async for b in channel.batches(idle_s=0.05)] == []
    channel = engine.open_channel("dropped")
    reader = asyncio.create_task(_collect(channel.batches(idle_s=30.0)))
    await asyncio.sleep(0.01)
    engine.drop_channel("dropped")
    assert await asyncio.wait_for(reader, 2.0) == []
    assert "dropped" not in engine.channel_keys()


async def _collect(batches) -> list:
    return [b async for b in batches]


async def test_a_channel_opened_mid_request_loses_and_repeats_nothing(engine):
    engine.stream_interval_s = 0.0
    plain = await stream_all(engine)
    engine.stream_interval_s = 0.05
    from_channel: dict[str, list] = {}

    async def one(i: int) -> list:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [chunk async for chunk in engine.generate(request, "c")]

    async def open_later() -> None:
        await asyncio.sleep(0.03)  # the streams are under way, some tokens held in them
        channel = engine.open_channel("c")
        async for batch in channel.batches(idle_s=0.5):
            for chunk in batch:
                from_channel.setdefault(chunk.request_id, []).append(chunk)

    reader = asyncio.create_task(open_later())
    results = await together(engine, [one(i) for i in range(len(PROMPTS))])
    await asyncio.wait_for(reader, 5.0)
    for i, own in enumerate(results):
        expected = [t for _, chunk in plain[f"r{i}"] for t in chunk]
        assert _assemble(own + from_channel.get(f"r{i}", [])) == expected


def test_a_steps_outputs_carry_plain_tokens_as_tuples_and_the_rest_whole():
    outputs = [
        RequestOutput("a", [5], num_prompt_tokens=3),
        RequestOutput("b", [6], "length", None, 4, {"queue_s": 0.1, "adapter_wait_s": 0.0}),
        RequestOutput("c", [], "error", "boom", 2, error_kind=ErrorKind.INTERNAL),
        RequestOutput("d", [7, 8], num_prompt_tokens=9),
    ]
    full, tokens = split_outputs(outputs)
    assert [o.request_id for o in full] == ["b", "c"]
    assert tokens == [("a", [5], 3), ("d", [7, 8], 9)]


async def test_a_channel_holds_a_requests_tokens_as_one_chunk_until_it_sends():
    """Token-only outputs of several steps become one chunk in the channel's batch (starting
    where they start), and a request's end takes what the channel still holds of it."""
    engine = AsyncEngine(_NullCore(), stream_interval_s=0.0)
    channel = engine.open_channel("c")
    streams = {}
    for rid in ("x", "y"):
        streams[rid] = engine.generate(GenerateRequest(rid, [1, 2], greedy(8)), channel_key="c")
        pending = asyncio.ensure_future(streams[rid].__anext__())
        await asyncio.sleep(0)
        engine._deliver_all([], [(rid, [10], 2)])  # the first token: its own stream
        assert (await pending).token_ids == [10]
    engine._deliver_all([], [("x", [11], 2), ("y", [21], 2)])
    engine._deliver_all([], [("x", [12, 13], 2)])
    engine._deliver_all([RequestOutput("y", [22], "stop", None, 2, {"queue_s": 0.0})], [])
    batch = await anext(channel.batches(idle_s=1.0))
    assert [(c.request_id, c.start, c.token_ids, c.finished) for c in batch] == [
        ("x", 1, [11, 12, 13], False)
    ]
    last = await anext(streams["y"])  # y's held token went with its last chunk
    assert (last.start, last.token_ids, last.finish_reason) == (1, [21, 22], "stop")
    engine.close_channel(channel)
    for stream in streams.values():
        await stream.aclose()


class _NullCore:
    """A core that takes every post and does nothing: the test drives `_deliver_all`."""

    alive = True

    def post(self, item: object) -> None:
        pass
