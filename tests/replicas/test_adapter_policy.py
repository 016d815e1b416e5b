"""The adapter tiers' plain-Python parts alone: the copy budget, read turns on a fake clock,
the loading modes, and the one-way import layering of `replicas/adapters/`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from replicas.adapters.modes import LOADING_MODES, loading_mode
from replicas.adapters.policy import (
    COPY_BYTES_PER_S,
    COPY_STEPS,
    SHORT_COPY_S,
    CopyBudget,
    ReadTurns,
)

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestCopyBudget:
    def test_an_idle_engine_admits_a_short_copy(self):
        budget = CopyBudget()
        assert budget.window_bytes == SHORT_COPY_S * COPY_BYTES_PER_S
        assert budget.admits(int(budget.window_bytes))
        assert not budget.admits(int(budget.window_bytes) + 1)

    def test_the_window_follows_the_step_time(self):
        budget = CopyBudget(short_copy_s=0.0)
        budget.step_time_s = 0.01
        assert budget.window_bytes == pytest.approx(COPY_STEPS * 0.01 * COPY_BYTES_PER_S)

    def test_a_requests_own_prefill_widens_the_window(self):
        budget = CopyBudget(short_copy_s=0.0, copy_bytes_per_s=1e9)
        budget.prefill_token_s = 1e-4  # 100 kB of copy per prefill token
        assert not budget.admits(1_000_000, prefill_tokens=9)
        assert budget.admits(1_000_000, prefill_tokens=10)

    def test_an_empty_load_stream_takes_any_copy_a_busy_one_only_the_window(self):
        budget = CopyBudget(short_copy_s=0.0, copy_bytes_per_s=1.0)
        budget.step_time_s = 50.0  # window: 100 bytes
        assert budget.may_queue(0, 10_000)
        assert budget.may_queue(60, 40)
        assert not budget.may_queue(60, 41)

    def test_observe_step_learns_what_a_prefill_token_adds(self):
        budget = CopyBudget()
        for _ in range(50):
            budget.observe_step(0.010, prefill_tokens=0, gated=False)
            budget.observe_step(0.010 + 500 * 40e-6, prefill_tokens=500, gated=False)
            # a step stretched by a copy, and one with too few prefill tokens to tell: not learnt
            budget.observe_step(0.100, prefill_tokens=500, gated=True)
            budget.observe_step(0.030, prefill_tokens=8, gated=False)
        assert budget.decode_step_s == pytest.approx(0.010, rel=1e-3)
        assert budget.prefill_token_s == pytest.approx(40e-6, rel=1e-2)
        assert 0.010 < budget.step_time_s < 0.100  # every step's time counts here


class TestReadTurns:
    def test_reads_take_turns(self):
        turns = ReadTurns(workers=1, stall_s=5.0, clock=FakeClock())
        assert turns.free(running=[])
        turns.start("a")
        assert not turns.free(running=["a"])
        assert turns.free(running=[])  # "a" is done, not yet collected

    def test_a_stalled_read_gives_up_its_turn(self):
        clock = FakeClock()
        turns = ReadTurns(workers=1, stall_s=5.0, clock=clock)
        turns.start("hung")
        clock.now += 4.9
        assert not turns.free(running=["hung"])
        clock.now += 0.2
        assert turns.free(running=["hung"])

    def test_finish_reports_how_long_the_read_ran(self):
        clock = FakeClock()
        turns = ReadTurns(clock=clock)
        turns.start("a")
        clock.now += 0.25
        assert turns.finish("a") == pytest.approx(0.25)

    def test_more_workers_more_reads_at_once(self):
        turns = ReadTurns(workers=2, clock=FakeClock())
        turns.start("a")
        turns.start("b")
        assert turns.free(running=["a"]) and not turns.free(running=["a", "b"])


class TestLoadingModes:
    def test_each_mode_adds_to_the_one_before(self):
        blocking, overlap, prefetch = (loading_mode(n) for n in ("blocking", "overlap", "prefetch"))
        assert not (blocking.background_reads or blocking.load_stream or blocking.prefetch)
        assert overlap.background_reads and overlap.load_stream and not overlap.prefetch
        assert prefetch.background_reads and prefetch.load_stream and prefetch.prefetch

    def test_an_unknown_mode_is_refused(self):
        with pytest.raises(ValueError, match="loading mode"):
            loading_mode("eager")
        assert set(LOADING_MODES) == {"blocking", "overlap", "prefetch"}


# The adapters package's layering: a module may import only modules of the layers below its own.
# `replicas.lora` (the GPU buffers) sits above all of them; nothing here imports it.
LAYERS = [
    {"stats", "modes", "policy", "host_cache", "slot_pool", "prefetcher", "host_threads"},
    {"peft_config", "safetensors_file"},
    {"layout", "hub"},
    {"loader"},
    {"registry", "uploader", "reader", "fetcher"},
    {"manager"},
]
# No torch: the policies, and what the ingress checks an adapter folder with.
PLAIN = [
    "stats",
    "modes",
    "policy",
    "host_cache",
    "slot_pool",
    "prefetcher",
    "peft_config",
    "safetensors_file",
    "layout",
    "hub",
]


def _imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / "replicas" / "adapters" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


class TestLayering:
    def test_every_module_is_in_a_layer(self):
        files = {p.stem for p in (ROOT / "replicas" / "adapters").glob("*.py")} - {"__init__"}
        assert files == set().union(*LAYERS)

    @pytest.mark.parametrize("level", range(len(LAYERS)))
    def test_modules_import_only_lower_layers(self, level):
        below = set().union(*LAYERS[:level])
        for module in LAYERS[level]:
            ours = {
                m.rsplit(".", 1)[1] for m in _imports(module) if m.startswith("replicas.adapters.")
            }
            assert ours <= below, f"{module} imports {ours - below} from its layer or above"
            others = {
                m
                for m in _imports(module)
                if m.startswith("replicas.") and not m.startswith("replicas.adapters")
            }
            allowed = {"replicas.errors", "replicas.models.spec", "replicas.scheduler"}
            assert others <= allowed, (module, others)

    def test_each_module_imports_alone_and_the_plain_ones_without_torch(self):
        """Each module first in a fresh set of `replicas` modules: an import circle through it
        would fail here. None of them pulls in `replicas.lora`."""
        code = f"""
import importlib, sys
for m in {PLAIN!r}:
    importlib.import_module('replicas.adapters.' + m)
assert 'torch' not in sys.modules, 'torch imported'
for m in {sorted(set().union(*LAYERS))!r}:
    for name in [n for n in sys.modules if n == 'replicas' or n.startswith('replicas.')]:
        del sys.modules[name]
    importlib.import_module('replicas.adapters.' + m)
    assert 'replicas.lora' not in sys.modules, m
"""
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
