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
