"""Host-side arithmetic for kernel launchers, in plain Python.

`triton.cdiv` and `triton.next_power_of_2` work on the host too, but `cdiv` is a JIT function:
called from Python it goes through the JIT's dispatch, several microseconds per call, on every
launch of an eager step.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


MAX_CACHED_LAUNCHES = 4096


class CachedLaunch:
    """Launches of one `@triton.jit` kernel that skip Triton's per-call dispatch.

    An eager step launches each kernel once per layer with the same shapes: Triton's dispatch
    (binding the arguments, specializing each of them, building the cache key, checking
    globals) costs tens of microseconds a launch, and a host-bound prefill step pays it for every
    launch. The first launch of a (plan, specialization) pair goes through Triton and keeps the
    compiled kernel it returns; later ones call that compiled kernel's launcher directly
    (`_compiled_launch`), with the constant arguments already in signature order.

    The specialization key covers what Triton specializes runtime arguments on: a tensor's dtype
    and whether its address is 16-byte aligned, an integer's equality to 1, divisibility by 16
    and 32-bit range. Runtime arguments must come first in the kernel's signature, constants
    (`tl.constexpr`) after them.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self.fast_launches = 0  # for tests: launches that skipped the dispatch

    def __call__(self, plan, args: tuple, cached: bool = True, **extra) -> None:
        """Launch over `plan.grid` with the runtime `args` and `plan.constants` (the constants
        and launch options), plus `extra` constants, which must follow from the arguments'
        specialization (a dtype's precision, say). Plans are memoized objects: keyed by identity.
        `cached` False: through Triton's dispatch every time (benchmarks compare)."""
        key = _specialization_key(id(plan), args)
        entry = self._compiled.get(key) if cached else None
        if entry is not None and entry[0] is plan:  # the plan held here keeps its id unique
            entry[1](args)
            self.fast_launches += 1
            return
        self._launch(key, plan, plan.grid, args, {**plan.constants, **extra})

    def run(self, grid: tuple[int, ...], args: tuple, cached: bool = True, **constants) -> None:
        """Launch over `grid` with the runtime `args` and `constants` (a few small values: they
        are part of the key); `cached` as for a call."""
        key = _specialization_key((grid, *constants.items()), args)
        entry = self._compiled.get(key) if cached else None
        if entry is not None:
            entry[1](args)
            self.fast_launches += 1
            return
        self._launch(key, None, grid, args, constants)

    def _launch(self, key: tuple, plan, grid: tuple[int, ...], args: tuple,
                constants: dict) -> None:
        compiled = self.kernel[grid](*args, **constants)
        names = self.kernel.arg_names[len(args):]
        if hasattr(compiled, "__getitem__") and all(n in constants for n in names):
            if len(self._compiled) >= MAX_CACHED_LAUNCHES:  # prefill sizes vary without end
                self._compiled.clear()
            gx, gy, gz = (*grid, *(1,) * (3 - len(grid)))  # a compiled kernel takes all three
            launch = _compiled_launch(compiled, (gx, gy, gz), tuple(constants[n] for n in names))
            self._compiled[key] = (plan, launch)


def _compiled_launch(compiled, grid: tuple[int, int, int], constants: tuple):
    """A call launching `compiled` over `grid` with (*args, *constants). `compiled[grid]` builds
    a closure, asks Triton's driver for the stream and builds launch metadata on every call;
    the compiled kernel's own launcher, given the current stream, does none of that (the host
    time saved: docs/perf/sgmv_tuning.md). Where the compiled kernel exposes that launcher,
    launches go to it directly while no launch hook is registered (profilers register them),
    and through `compiled[grid]` otherwise."""
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    metadata = getattr(compiled, "packed_metadata", None)
    knobs = _runtime_knobs()
    if run is None or function is None or metadata is None or knobs is None:
        return lambda args: compiled[grid](*args, *constants)
    gx, gy, gz = grid

    def launch(args: tuple) -> None:
        if _idle(knobs.launch_enter_hook) and _idle(knobs.launch_exit_hook):
            run(gx, gy, gz, current_stream(), function, metadata, None, None, None, *args,
                *constants)
        else:
            compiled[grid](*args, *constants)

    return launch


def _runtime_knobs():
    """Triton's runtime settings, which hold its launch hooks (`triton.knobs`, Triton 3.4 and
    later), or None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def _idle(hook) -> bool:
    """No hook: None, or Triton's chain of hooks holding none."""
    return hook is None or getattr(hook, "calls", None) == []


def current_stream() -> int:
    """The current CUDA stream of the current device, as a raw handle: what Triton's driver
    reads for a launch (`torch.cuda.current_stream()` builds a Stream object, microseconds a
    call)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _specialization_key(head, args: tuple) -> tuple:
    """`head` and what Triton specializes each argument on, flattened into one tuple: a
    tensor's dtype and whether its address is 16-byte aligned; an integer's equality to 1,
    divisibility by 16 and 32-bit range; nothing for a float. An argument's kind is fixed by its
    position in a kernel's signature, so the flat entries cannot run together. One loop, no call
    per argument: an eager step builds a key for every launch."""
    key = [head]
    for a in args:
        if isinstance(a, int):
            key += (a == 1, not a & 15, -2147483648 <= a < 2147483648)
        elif not isinstance(a, float):
            key += (a.dtype, not a.data_ptr() & 15)
    return tuple(key)
