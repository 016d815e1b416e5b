"""What a replica's work costs, for the simulator: one model step, one host->GPU adapter copy,
one disk read. Written as JSON by `python -m sim.calibrate` (measured with the real engine),
read here.

The step time model (`StepCost`, in `replicas/step_cost.py`, which the timed runner replays
too), fitted by least squares to measured steps:

    step_s = base_s + per_seq_s * seqs + per_adapter_s * adapters + prefill_token_s * prefill

`seqs` is the number of sequences in the step, `adapters` the distinct adapters among them
(SGMV's cost grows with both), `prefill` the prompt tokens computed in the step. Decode steps
cost base + per_seq + per_adapter terms; a prefill chunk adds its tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from replicas.step_cost import StepCost, StepSample


@dataclass(frozen=True)
class Calibration:
    """Costs of one replica's work; `source` says what measured them (command, device, date)."""

    step: StepCost
    copy_s: float  # one adapter host -> GPU slot (pinned, on the load stream)
    read_s: float  # one adapter disk -> pinned host memory
    adapter_bytes: int  # one adapter's weights (the copy budget counts bytes)
    source: dict[str, Any] = field(default_factory=dict)
    samples: tuple[StepSample, ...] = ()

    def __post_init__(self) -> None:
        if min(self.copy_s, self.read_s) < 0 or self.adapter_bytes < 1:
            raise ValueError("copy and read times cannot be negative; adapters have bytes")
        if self.step.base_s <= 0 and self.step.per_seq_s <= 0:
            raise ValueError("a step must take some time")

    def step_s(self, seqs: int, adapters: int, prefill_tokens: int) -> float:
        return self.step.step_s(seqs, adapters, prefill_tokens)

    @property
    def rank(self) -> int:
        """The adapter rank the costs were measured with (16 when the source does not say)."""
        return int(self.source.get("rank", 16))

    def for_rank(self, rank: int) -> Calibration:
        """These costs for rank-`rank` adapters of the same projections: an adapter's bytes,
        its copy, its read and its share of a step's SGMV time grow with the rank; the base
        model's terms do not. An estimate until a calibration at that rank is recorded."""
        if rank < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        if rank == self.rank:
            return self
        f = rank / self.rank
        return Calibration(
            step=replace(self.step, per_adapter_s=self.step.per_adapter_s * f),
            copy_s=self.copy_s * f,
            read_s=self.read_s * f,
            adapter_bytes=max(1, round(self.adapter_bytes * f)),
            source={**self.source, "rank": rank, "scaled_from_rank": self.rank},
        )

    @property
    def copy_bytes_per_s(self) -> float:
        return self.adapter_bytes / self.copy_s if self.copy_s > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["samples"] = [asdict(s) for s in self.samples]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        try:
            return cls(
                step=StepCost(**data["step"]),
                copy_s=float(data["copy_s"]),
                read_s=float(data["read_s"]),
                adapter_bytes=int(data["adapter_bytes"]),
                source=dict(data.get("source", {})),
                samples=tuple(StepSample(**s) for s in data.get("samples", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a simulator calibration: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_json(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


# Until a GPU calibration is recorded: Llama-3-8B shapes on an H100 with rank-16 adapters
# (about 80 MB), from docs/DESIGN.md's reference numbers (weights read once per decode step at
# about 3 TB/s, 1.5 ms per adapter over pinned PCIe) and benchmarks/results/adapter_read_r16
# (one read about 32 ms).
DEFAULT = Calibration(
    step=StepCost(base_s=0.012, per_seq_s=0.00015, per_adapter_s=0.0002, prefill_token_s=4e-5),
    copy_s=0.0015,
    read_s=0.032,
    adapter_bytes=80 * 2**20,
    source={"estimate": "DESIGN.md reference numbers, Llama-3-8B on H100, rank 16"},
)
