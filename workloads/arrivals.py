"""When each request is sent: a seeded arrival process at a target rate."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    count: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Send times of `count` requests in seconds after the start: shape [count], non-decreasing,
    the first at 0.

    Gaps between arrivals are Gamma-distributed with mean 1 / `rate` and shape `burstiness`, so
    their squared coefficient of variation is 1 / `burstiness`: 1 is a Poisson process, below 1
    arrivals come in bursts separated by lulls, above 1 they are more regular. `rate` inf sends
    everything at once.

    The gaps are drawn at unit rate and then scaled, so the same `rng` state gives the same
    arrival pattern at every rate, only stretched or squeezed in time (a sweep over rates
    compares like with like).
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if count == 0:
        return np.zeros(0)
    unit_gaps = rng.standard_gamma(burstiness, size=count - 1) / burstiness  # mean 1
    if math.isinf(rate):
        return np.zeros(count)
    return np.concatenate([[0.0], np.cumsum(unit_gaps / rate)])
