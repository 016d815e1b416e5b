"""The engine in a process of its own (`replicas.engine_process.ProcessCore`): the same tokens
as on a thread, calls and their errors cross the pipe, and every way the child can end (shut
down, killed, its parent killed, a failed start) leaves no stream or call hanging."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from replicas import engine_calls
from replicas.adapter_ledger import LoadMismatch, Superseded
from replicas.async_engine import AsyncEngine
from replicas.engine import Engine, RequestRejected
from replicas.engine_core import build_core
from replicas.engine_loop import EngineStopped
from replicas.engine_process import ProcessCore
from replicas.engine_stats import EngineStats
from replicas.errors import ErrorKind
from replicas.protocol import GenerateRequest
from tests.engines import FailingEngine, GatedEngine
from tests.replicas.conftest import greedy
from tests.replicas.test_async_engine import PROMPTS, engine_config, together

MAX_TOKENS = 16
DEATH_S = 30.0  # the most a dead child or parent may take to be noticed


def front(config, engine_cls: type[Engine] = Engine) -> AsyncEngine:
    core, _ = build_core(config, engine_cls)
    engine = AsyncEngine(core, stream_interval_s=0.0)
    engine.start()
    return engine


async def tokens_of(engine: AsyncEngine) -> dict[str, list[int]]:
    async def one(i: int) -> list[int]:
        request = GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS))
        return [t async for chunk in engine.generate(request) for t in chunk.token_ids]

    results = await together(engine, [one(i) for i in range(len(PROMPTS))])
    return {f"r{i}": tokens for i, tokens in enumerate(results)}


@pytest.fixture(scope="module")
def process_engine(models):
    engine = front(engine_config(models["llama"], engine_process=True), GatedEngine)
    yield engine
    engine.shutdown()


def _unpicklable_answer(engine: Engine) -> object:
    return lambda: None


def _sleep_forever(engine: Engine) -> None:
    time.sleep(3600)  # a call that never answers: pending when its process dies


def _frozen_objects(engine: Engine) -> int:
    return gc.get_freeze_count()


def _raise_plain(engine: Engine, message: str) -> None:
    raise KeyError(message)


class TestTheSameEngine:
    async def test_greedy_tokens_match_the_engine_on_a_thread(self, models, process_engine):
        on_thread = front(engine_config(models["llama"]), GatedEngine)
        try:
            expected = await tokens_of(on_thread)
        finally:
            on_thread.shutdown()
        got = await tokens_of(process_engine)
        assert got == expected
        assert all(len(tokens) == MAX_TOKENS for tokens in got.values())
        assert process_engine.step_cpu_s > 0

    async def test_calls_round_trip_with_their_results(self, process_engine):
        info = await process_engine.call(engine_calls.engine_info)
        assert info["vocab_size"] > 0 and info["max_model_len"] > 0
        stats, held = await process_engine.call(engine_calls.read_engine)
        assert isinstance(stats, EngineStats) and held == 0
        assert await process_engine.call(Engine.adapter_status) == {}

    async def test_slowest_steps_after_a_step_number_on_this_hosts_clock(self, process_engine):
        stats, _ = await process_engine.call(engine_calls.read_engine)
        started = time.monotonic()
        await tokens_of(process_engine)
        slow = await process_engine.call(engine_calls.slowest_steps, stats.num_steps, 3)
        assert len(slow) == 3
        assert [s["step_ms"] for s in slow] == sorted((s["step_ms"] for s in slow), reverse=True)
        # the child's monotonic clock is this process's: its steps began inside this window
        assert all(started <= s["started"] <= time.monotonic() for s in slow)
        assert all(s["num_tokens"] >= s["num_seqs"] >= 1 for s in slow)
        assert all(0 <= s["launch_ms"] <= s["step_ms"] for s in slow)
        stats, _ = await process_engine.call(engine_calls.read_engine)
        assert await process_engine.call(engine_calls.slowest_steps, stats.num_steps, 3) == []

    async def test_start_up_objects_are_out_of_the_loops_collections(self, process_engine):
        # The child's own count: the model and the imports at least.
        assert await process_engine.call(_frozen_objects) > 10_000

    async def test_a_calls_exception_round_trips_with_its_kind(self, process_engine):
        with pytest.raises(RequestRejected, match="not loaded") as caught:
            await process_engine.call(engine_calls.unload_adapter, "nope", None, None)
        assert caught.value.kind is ErrorKind.NOT_FOUND
        with pytest.raises(KeyError, match="plain"):
            await process_engine.call(_raise_plain, "plain")
        assert process_engine.alive

    async def test_what_cannot_cross_fails_the_call_alone(self, process_engine):
        with pytest.raises(RuntimeError, match="did not cross processes"):
            await process_engine.call(_unpicklable_answer)
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            await process_engine.call(lambda engine: engine.stats())  # a lambda never leaves
        assert await process_engine.call(engine_calls.engine_info)  # the engine goes on


@pytest.mark.parametrize(
    "error",
    [
        RequestRejected("bad adapter", ErrorKind.INVALID, param="model", code="x"),
        LoadMismatch("not this load"),
        Superseded("gone"),
        EngineStopped("the engine stopped"),
    ],
)
def test_serving_errors_keep_their_kind_across_processes(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert (copy.kind, copy.param, copy.code) == (error.kind, error.param, error.code)


class TestFaults:
    async def test_a_killed_child_ends_every_stream_and_call_at_once(self, models):
        engine = front(engine_config(models["llama"], engine_process=True), GatedEngine)
        try:
            await engine.call(GatedEngine.set_hold, "started")  # streams stay open after 1 token
            streams = [
                engine.generate(GenerateRequest(f"r{i}", PROMPTS[i], greedy(MAX_TOKENS)))
                for i in range(2)
            ]
            firsts = [await anext(stream) for stream in streams]
            assert all(len(first.token_ids) == 1 for first in firsts)
            pending = asyncio.ensure_future(engine.call(_sleep_forever))
            core = engine.core
            assert isinstance(core, ProcessCore) and core.pid is not None
            os.kill(core.pid, signal.SIGKILL)
            for stream in streams:
                rest = await asyncio.wait_for(_collect(stream), DEATH_S)
                last = rest[-1]
                assert last.finish_reason == "error" and not any(c.finished for c in rest[:-1])
                assert last.error is not None and last.error.kind is ErrorKind.UNAVAILABLE
                assert "exited" in last.error.message
            with pytest.raises(EngineStopped):
                await asyncio.wait_for(pending, DEATH_S)
            assert not engine.alive
            assert isinstance(engine.last_error, EngineStopped)
            with pytest.raises(EngineStopped):
                await engine.call(engine_calls.engine_info)
            late = GenerateRequest("late", PROMPTS[0], greedy(MAX_TOKENS))
            [chunk] = [chunk async for chunk in engine.generate(late)]
            assert chunk.error is not None and chunk.error.kind is ErrorKind.UNAVAILABLE
        finally:
            engine.shutdown()

    async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(self, models):
        engine = front(engine_config(models["llama"], engine_process=True), FailingEngine)
        try:
            request = GenerateRequest("r0", PROMPTS[0], greedy(MAX_TOKENS))
            [chunk] = [chunk async for chunk in engine.generate(request)]
            assert chunk.error is not None and chunk.error.kind is ErrorKind.INTERNAL
            assert "the device fell over" in chunk.error.message
            assert "the device fell over" in str(engine.last_error)
            assert engine.alive and await engine.call(engine_calls.engine_info)
        finally:
            engine.shutdown()

    def test_shutdown_stops_the_child_cleanly(self, models):
        engine = front(engine_config(models["llama"], engine_process=True))
        core = engine.core
        assert isinstance(core, ProcessCore) and engine.alive
        engine.shutdown()
        assert not engine.alive
        assert core._process.exitcode == 0

    def test_a_start_up_error_is_raised_by_the_constructor_with_its_text(self, tmp_path):
        missing = engine_config(tmp_path / "no-such-model")
        with pytest.raises(Exception) as on_thread:
            build_core(missing)
        with pytest.raises(Exception) as in_process:
            build_core(engine_config(tmp_path / "no-such-model", engine_process=True))
        assert str(in_process.value) == str(on_thread.value)
        assert type(in_process.value) is type(on_thread.value)

    def test_the_child_dies_with_its_parent(self, models, tmp_path):
        """A parent killed outright (no shutdown, no atexit) takes its engine process along."""
        script = textwrap.dedent(
            f"""
            import os, sys
            sys.path.insert(0, {os.getcwd()!r})
            from replicas.engine_core import build_core
            from tests.replicas.test_async_engine import engine_config

            if __name__ == "__main__":
                core, _ = build_core(engine_config({str(models["llama"])!r}, engine_process=True))
                print(core.pid, flush=True)
                sys.stdin.read()  # until the test kills this process
            """
        )
        (tmp_path / "parent.py").write_text(script)
        parent = subprocess.Popen(
            [sys.executable, str(tmp_path / "parent.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            assert _alive(child)
        finally:
            parent.kill()
            parent.wait()
        deadline = time.monotonic() + DEATH_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)  # the kernel's signal, not ours to wait on otherwise
        assert not _alive(child)


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by its init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
