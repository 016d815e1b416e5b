"""`kernels.launch.CachedLaunch` against a stand-in for a Triton kernel: which launches reuse a
compiled kernel and which go through the dispatch again. (On a GPU, tests/gpu/test_sgmv_launch.py
checks the real kernels' results.)"""

from dataclasses import dataclass, field

import pytest
import torch

from kernels import launch
from kernels.launch import CachedLaunch


class FakeCompiled:
    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        def runner(*args):
            self.log.append(("compiled", grid, args))

        return runner


class FakeLauncher(FakeCompiled):
    """A compiled kernel as Triton's: also its launcher (`run`), loaded function and packed
    metadata, which CachedLaunch calls directly while no launch hook is registered."""

    function = 0xF00
    packed_metadata = (4, 1, 0)

    def run(self, *call):
        self.log.append(("run", *call))


class FakeKernel:
    """What CachedLaunch uses of a @triton.jit function: `arg_names` and `kernel[grid](...)`,
    which returns the compiled kernel."""

    arg_names = ["x_ptr", "n", "BLOCK", "EVEN"]

    def __init__(self) -> None:
        self.log: list = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def dispatch(*args, **constants):
            self.log.append(("dispatch", grid, args, constants))
            return self.compiled

        return dispatch


@dataclass(frozen=True)
class Plan:
    grid: tuple
    constants: dict = field(hash=False)


def kinds(log) -> list[str]:
    return [entry[0] for entry in log]


def test_repeated_launches_skip_the_dispatch_with_constants_in_signature_order():
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    plan = Plan((4,), {"EVEN": True, "BLOCK": 64, "num_warps": 4})
    x = torch.zeros(32)
    for _ in range(3):
        cached(plan, (x, 32))
    assert kinds(kernel.log) == ["dispatch", "compiled", "compiled"]
    assert kernel.log[0][3] == {"EVEN": True, "BLOCK": 64, "num_warps": 4}
    _, grid, args = kernel.log[1]
    assert grid == (4, 1, 1)  # a compiled kernel takes a three-dimensional grid
    assert args == (x, 32, 64, True)  # launch options are not arguments
    assert cached.fast_launches == 2


@pytest.mark.parametrize("change", ["unaligned", "dtype", "one", "not_16", "other_plan"])
def test_another_specialization_goes_through_the_dispatch(change):
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    plan = Plan((4,), {"BLOCK": 64, "EVEN": True})
    x = torch.zeros(64)
    cached(plan, (x, 32))
    other = {
        "unaligned": (plan, (x[1:], 32)),  # 4 bytes past a 16-byte boundary
        "dtype": (plan, (x.double(), 32)),
        "one": (plan, (x, 1)),
        "not_16": (plan, (x, 33)),
        "other_plan": (Plan((4,), {"BLOCK": 64, "EVEN": True}), (x, 32)),
    }[change]
    cached(*other)
    assert kinds(kernel.log) == ["dispatch", "dispatch"]
    cached(*other)  # and is cached in turn
    assert kinds(kernel.log) == ["dispatch", "dispatch", "compiled"]


def test_grid_launches_key_on_grid_and_constants():
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    x = torch.zeros(16)
    cached.run((2,), (x, 16), BLOCK=32, EVEN=False)
    cached.run((2,), (x, 16), BLOCK=32, EVEN=False)
    cached.run((3,), (x, 16), BLOCK=32, EVEN=False)  # another grid
    cached.run((2,), (x, 16), BLOCK=64, EVEN=False)  # another constant
    cached.run((3,), (x, 16), BLOCK=32, EVEN=False)
    assert kinds(kernel.log) == ["dispatch", "compiled", "dispatch", "dispatch", "compiled"]
    assert kernel.log[1][2] == (x, 16, 32, False)


def test_switched_off_every_launch_is_dispatched():
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    plan = Plan((1,), {"BLOCK": 8, "EVEN": True})
    for _ in range(3):
        cached(plan, (torch.zeros(8), 8), cached=False)
    x = torch.zeros(8)
    for _ in range(2):
        cached.run((2,), (x, 8), False, BLOCK=8, EVEN=True)
    assert kinds(kernel.log) == ["dispatch"] * 5


def test_a_kernel_that_returns_nothing_is_never_cached():
    # Triton's interpreter returns no compiled kernel: every launch goes through it.
    kernel = FakeKernel()
    kernel.compiled = None
    cached = CachedLaunch(kernel)
    plan = Plan((1,), {"BLOCK": 8, "EVEN": True})
    for _ in range(2):
        cached(plan, (torch.zeros(8), 8))
    assert kinds(kernel.log) == ["dispatch", "dispatch"]


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "MAX_CACHED_LAUNCHES", 3)
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    x = torch.zeros(8)
    for n in range(2, 7):  # five grids: the cache empties when it holds three
        cached.run((n,), (x, 8), BLOCK=8, EVEN=True)
    assert len(cached._compiled) <= 3
    cached.run((6,), (x, 8), BLOCK=8, EVEN=True)
    assert kinds(kernel.log)[-1] == "compiled"


def test_compiled_launchers_are_called_directly_with_the_current_stream(monkeypatch):
    pytest.importorskip("triton.knobs")
    kernel = FakeKernel()
    kernel.compiled = FakeLauncher(kernel.log)
    monkeypatch.setattr(launch, "current_stream", lambda: 77)
    cached = CachedLaunch(kernel)
    plan = Plan((4,), {"EVEN": True, "BLOCK": 64, "num_warps": 4})
    x = torch.zeros(32)
    for _ in range(2):
        cached(plan, (x, 32))
    assert kinds(kernel.log) == ["dispatch", "run"]
    # grid, stream, function, metadata, no launch metadata nor hooks, args, constants
    assert kernel.log[1][1:] == (4, 1, 1, 77, 0xF00, (4, 1, 0), None, None, None, x, 32, 64, True)


def test_a_registered_launch_hook_sends_launches_through_triton(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    kernel = FakeKernel()
    kernel.compiled = FakeLauncher(kernel.log)
    monkeypatch.setattr(launch, "current_stream", lambda: 77)
    cached = CachedLaunch(kernel)
    x = torch.zeros(16)
    cached.run((2,), (x, 16), BLOCK=32, EVEN=False)
    record = []
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton's chain of hooks
        hook.add(record.append)
    else:
        knobs.runtime.launch_enter_hook = record.append
    try:
        cached.run((2,), (x, 16), BLOCK=32, EVEN=False)  # a profiler listening: through Triton
    finally:
        if hasattr(hook, "remove"):
            hook.remove(record.append)
        else:
            knobs.runtime.launch_enter_hook = hook
    cached.run((2,), (x, 16), BLOCK=32, EVEN=False)
    assert kinds(kernel.log) == ["dispatch", "compiled", "run"]


@pytest.mark.parametrize("values", [(1, 1), (1, 17), (16, 32), (2**31, 8), (8, 2**31 - 1)])
def test_the_key_tells_apart_what_triton_specializes_integers_on(values):
    kernel = FakeKernel()
    cached = CachedLaunch(kernel)
    plan = Plan((1,), {"BLOCK": 8, "EVEN": True})
    x = torch.zeros(8)
    cached(plan, (x, values[0]))
    cached(plan, (x, values[1]))
    same = (values[0] == 1) == (values[1] == 1) and (values[0] % 16 == 0) == (
        values[1] % 16 == 0) and (values[0] < 2**31) == (values[1] < 2**31)
    assert kinds(kernel.log) == ["dispatch", "compiled" if same else "dispatch"]
