"""What one model step costs, as the simulator models it and the timed runner replays it:

    step_s = base_s + per_seq_s * seqs + per_adapter_s * adapters + prefill_token_s * prefill

fitted by least squares to steps measured on a GPU (`python -m sim.calibrate`, whose JSON keeps
the coefficients under "step"). `seqs` is the number of sequences in the step, `adapters` the
distinct adapters among them, `prefill` the prompt tokens computed in the step.

`host_share` is the part of a step the host spends launching it, holding the GIL (the model
runner's `last_launch_s` over the step); the timed runner spends it running Python, so the
threads that share the engine's process wait for it as they do for a GPU step's launches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class StepSample:
    """One measured step: what it computed and how long it took."""

    seqs: int
    adapters: int
    prefill_tokens: int
    seconds: float


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_seq_s: float
    per_adapter_s: float
    prefill_token_s: float
    host_share: float = 0.0

    def step_s(self, seqs: int, adapters: int, prefill_tokens: int) -> float:
        return (
            self.base_s
            + self.per_seq_s * seqs
            + self.per_adapter_s * adapters
            + self.prefill_token_s * prefill_tokens
        )

    @classmethod
    def fit(cls, samples: Sequence[StepSample]) -> StepCost:
        """Least squares over the samples, every coefficient clipped at 0 (a negative cost is
        noise). Needs samples that vary each term, else that term's coefficient is 0."""
        if len(samples) < 4:
            raise ValueError(f"need at least 4 step samples to fit 4 terms, got {len(samples)}")
        x = np.array([[1.0, s.seqs, s.adapters, s.prefill_tokens] for s in samples])
        y = np.array([s.seconds for s in samples])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        base, per_seq, per_adapter, per_token = (max(0.0, float(c)) for c in coef)
        return cls(base, per_seq, per_adapter, per_token)


def load_step_cost(path: str | Path) -> StepCost:
    """The `step` coefficients of a calibration file `sim.calibrate` wrote."""
    try:
        cost = StepCost(
            **{k: float(v) for k, v in json.loads(Path(path).read_text())["step"].items()}
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a step calibration (sim.calibrate's JSON): {e}") from None
    if min(cost.base_s, cost.per_seq_s, cost.per_adapter_s, cost.prefill_token_s) < 0:
        raise ValueError(f"{path}: step costs cannot be negative")
    if not 0.0 <= cost.host_share <= 1.0:
        raise ValueError(f"{path}: host_share is a share of a step, in [0, 1]")
    return cost
