"""Which adapter each request names: round robin, or a seeded draw from a popularity law.

Adapters are ranked by their position in the list given: under `skewed`, `zipf` and `hot` the
first is the most popular (under `hot` it takes half the requests).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _uniform(n: int, alpha: float, zipf_s: float) -> np.ndarray:
    return np.ones(n)


def _skewed(n: int, alpha: float, zipf_s: float) -> np.ndarray:
    # Geometric: each adapter is `alpha` times as popular as the one before it.
    return alpha ** np.arange(n, dtype=float)


def _zipf(n: int, alpha: float, zipf_s: float) -> np.ndarray:
    return 1.0 / np.arange(1, n + 1, dtype=float) ** zipf_s


def _hot(n: int, alpha: float, zipf_s: float) -> np.ndarray:
    # The first adapter takes half the requests, the others share the rest evenly.
    weights = np.ones(n)
    weights[0] = max(n - 1, 1)
    return weights


_WEIGHTS: dict[str, Callable[[int, float, float], np.ndarray]] = {
    "distinct": _uniform,  # round robin: every adapter equally often, in order
    "uniform": _uniform,
    "skewed": _skewed,
    "zipf": _zipf,
    "hot": _hot,
}
POPULARITIES = tuple(_WEIGHTS)


def popularity_weights(kind: str, n: int, *, alpha: float = 0.7, zipf_s: float = 1.0) -> np.ndarray:
    """The probability of each of `n` adapters under `kind`: shape [n], sums to 1."""
    check_popularity(kind, alpha=alpha, zipf_s=zipf_s)
    if n < 1:
        raise ValueError(f"need at least one adapter, got {n}")
    weights = _WEIGHTS[kind](n, alpha, zipf_s)
    return weights / weights.sum()


def pick_adapters(
    kind: str,
    n: int,
    count: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.7,
    zipf_s: float = 1.0,
) -> np.ndarray:
    """Indices into the `n` adapters for `count` requests: shape [count], ints in [0, n).
    `distinct` cycles 0, 1, ..., n-1, 0, ... and draws nothing from `rng`."""
    weights = popularity_weights(kind, n, alpha=alpha, zipf_s=zipf_s)
    if kind == "distinct":
        return np.arange(count) % n
    return rng.choice(n, size=count, p=weights)


def check_popularity(kind: str, *, alpha: float, zipf_s: float) -> None:
    if kind not in POPULARITIES:
        raise ValueError(f"unknown popularity {kind!r}; choose from {', '.join(POPULARITIES)}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not zipf_s > 0:
        raise ValueError(f"the zipf exponent must be > 0, got {zipf_s}")
