"""Host-side arithmetic for kernel launchers, in plain Python.

`triton.cdiv` and `triton.next_power_of_2` work on the host too, but `cdiv` is a JIT function:
called from Python it goes through the JIT's dispatch, several microseconds per call, on every
launch of an eager step.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


MAX_CACHED_LAUNCHES = 4096
CACHED_LAUNCHES = True  # off: every launch goes through Triton's dispatch (benchmarks compare)


class CachedLaunch:
    """Launches of one `@triton.jit` kernel that skip Triton's per-call dispatch.

    An eager step launches each kernel once per layer with the same shapes: Triton's dispatch
    (binding the arguments, specializing each of them, building the cache key, checking
    globals) costs tens of microseconds a launch, and a host-bound prefill step pays it for every
    launch. The first launch of a (plan, specialization) pair goes through Triton and keeps the
    compiled kernel it returns; later ones call that compiled kernel directly, with the constant
    arguments already in signature order.

    The specialization key covers what Triton specializes runtime arguments on: a tensor's dtype
    and whether its address is 16-byte aligned, an integer's equality to 1, divisibility by 16
    and 32-bit range. Runtime arguments must come first in the kernel's signature, constants
    (`tl.constexpr`) after them.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self.fast_launches = 0  # for tests: launches that skipped the dispatch

    def __call__(self, plan, args: tuple, **extra) -> None:
        """Launch over `plan.grid` with the runtime `args` and `plan.constants` (the constants
        and launch options), plus `extra` constants, which must follow from the arguments'
        specialization (a dtype's precision, say). Plans are cached objects: keyed by identity."""
        key = (id(plan), *(_specialization(a) for a in args))
        entry = self._compiled.get(key) if CACHED_LAUNCHES else None
        if entry is not None and entry[0] is plan:  # the plan held here keeps its id unique
            entry[1][entry[3]](*args, *entry[2])
            self.fast_launches += 1
            return
        self._launch(key, plan, plan.grid, args, {**plan.constants, **extra})

    def run(self, grid: tuple[int, ...], args: tuple, **constants) -> None:
        """Launch over `grid` with the runtime `args` and `constants` (a few small values: they
        are part of the key)."""
        key = (grid, *constants.items(), *(_specialization(a) for a in args))
        entry = self._compiled.get(key) if CACHED_LAUNCHES else None
        if entry is not None:
            entry[1][entry[3]](*args, *entry[2])
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
            grid3 = (*grid, *(1,) * (3 - len(grid)))  # a compiled kernel takes all three
            self._compiled[key] = (plan, compiled, tuple(constants[n] for n in names), grid3)


def _specialization(value) -> tuple:
    if isinstance(value, int):
        return (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
    if isinstance(value, float):  # not specialized: a float32 argument
        return ()
    return (value.dtype, value.data_ptr() % 16 == 0)
