"""`ShardedClient`: the same records as one client, from worker processes, against the fake
OpenAI server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadgen.records import Outcome
from loadgen.runner import LoadConfig, run_load
from loadgen.shards import ShardedClient, WorkerLost
from tests.loadgen.fake_server import ADAPTERS, BROKEN, FakeConfig, serve
from workloads.requests import RequestSpec


def specs(n: int, output_len: int = 6) -> list[RequestSpec]:
    return [
        RequestSpec(
            index=i, model=ADAPTERS[i % len(ADAPTERS)], is_base=False, prompt=(1, 2, 3 + i),
            input_len=3, output_len=output_len,
        )
        for i in range(n)
    ]  # fmt: skip


async def test_every_request_comes_back_with_its_own_record(fake_url):
    async with ShardedClient(fake_url, shards=2) as client:
        result = await run_load(client, specs(12), LoadConfig())
        assert await client.adapter_stats() is not None  # asked from this process
    assert [r.index for r in result.records] == list(range(12))
    assert all(r.outcome is Outcome.OK and r.output_tokens == 6 for r in result.records)
    assert all(r.model == ADAPTERS[r.index % len(ADAPTERS)] for r in result.records)


async def test_requests_are_spread_over_the_workers():
    with serve(FakeConfig(token_delay_s=0.01)) as (url, state):
        async with ShardedClient(url, shards=2) as client:
            t0 = time.perf_counter()
            sends = [asyncio.create_task(client.send(s, 0.0, t0)) for s in specs(8)]
            await asyncio.sleep(0)
            assert sorted(shard.in_flight for shard in client._shards) == [4, 4]
            records = await asyncio.gather(*sends)
    assert all(r.ok for r in records)
    assert len(state.bodies) == 8


async def test_times_are_on_this_process_clock(fake_url):
    """A worker's `perf_counter` is this process's: sent_s is measured from our `t0`."""
    async with ShardedClient(fake_url, shards=1) as client:
        t0 = time.perf_counter() - 5.0  # the run "started" 5 s ago
        record = await client.send(specs(1)[0], 0.0, t0)
    assert record.ok and 5.0 <= record.sent_s < 5.0 + 30.0


async def test_failures_come_back_as_records(fake_url):
    broken = RequestSpec(index=0, model=BROKEN, is_base=False, prompt=(1,), input_len=1,
                         output_len=4)  # fmt: skip
    unknown = RequestSpec(index=1, model="nobody", is_base=False, prompt=(1,), input_len=1,
                          output_len=4)  # fmt: skip
    async with ShardedClient(fake_url, shards=2) as client:
        records = await asyncio.gather(
            client.send(broken, 0.0, 0.0), client.send(unknown, 0.0, 0.0)
        )
    assert records[0].outcome is Outcome.STREAM_ERROR
    assert records[1].outcome is Outcome.HTTP_ERROR and records[1].status == 404


async def test_a_cancelled_send_closes_its_stream_in_the_worker():
    with serve(FakeConfig(token_delay_s=0.05, capacity=1)) as (url, state):
        async with ShardedClient(url, shards=1) as client:
            slow = asyncio.create_task(client.send(specs(1, output_len=400)[0], 0.0, 0.0))
            while not state.bodies:
                await asyncio.sleep(0.01)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            # The fake streams one request at a time: the next one gets its turn only once
            # the cancelled stream is closed.
            record = await asyncio.wait_for(client.send(specs(2)[1], 0.0, 0.0), 30)
    assert record.ok


async def test_a_worker_that_dies_fails_its_requests_loudly():
    with serve(FakeConfig(token_delay_s=0.05)) as (url, _):
        async with ShardedClient(url, shards=1) as client:
            pending = asyncio.create_task(client.send(specs(1, output_len=400)[0], 0.0, 0.0))
            await asyncio.sleep(0.2)
            client._shards[0].process.kill()
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(pending, 30)
            with pytest.raises(WorkerLost):
                await client.send(specs(1)[0], 0.0, 0.0)


def test_at_least_one_worker():
    with pytest.raises(ValueError, match="at least 1"):
        ShardedClient("http://127.0.0.1:1", shards=0)
