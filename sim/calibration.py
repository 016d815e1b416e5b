"""What a replica's work costs, for the simulator: one model step, one host->GPU adapter copy,
one disk read. Written as JSON by `python -m sim.calibrate` (measured with the real engine),
read here.

The step time model (`StepCost`, in `replicas/step_cost.py`, which the timed runner replays
too), fitted by least squares to measured steps:

    step_s = base_s + per_seq_s * seqs + per_adapter_s * adapters + prefill_token_s * prefill

`seqs` is the number of sequences in the step, `adapters` the distinct adapters among them
(SGMV's cost grows with both), `prefill` the prompt tokens computed in the step. Decode steps
cost base + per_seq + per_adapter terms; a prefill chunk adds its tokens.

A disk read costs one of two times. `read_s` is a read that must allocate its pinned buffers
(`sim.calibrate` reads into a host cache with room for every adapter, so each read does). Once
the host cache is full, each read that lands in it evicts an adapter, whose buffers PyTorch's
caching host allocator hands to the next read of the same size: that read skips the allocation
(`reuse_read_s`). Allocating dominates: a rank-16 read took 92 ms allocating on an H200, and
41 ms into reused buffers in an H100 engine (`REUSED_READS`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from replicas.step_cost import StepCost, StepSample

# Disk reads into reused pinned buffers, (rank, seconds), as the engine timed them on an H100
# (`EngineStats.adapter_read_seconds`): benchmarks/results/churn_128x_r16.json and
# churn_128x_r128.json, prefetch mode, uniform popularity, 128 Llama-3-8B-shaped adapters over a
# host cache of 32 that the warm-up had filled (59 and 39 reads). No H200 figure is recorded.
REUSED_READS: tuple[tuple[int, float], ...] = ((16, 0.04074), (128, 0.15244))


@dataclass(frozen=True)
class Calibration:
    """Costs of one replica's work; `source` says what measured them (command, device, date)."""

    step: StepCost
    copy_s: float  # one adapter host -> GPU slot (pinned, on the load stream)
    read_s: float  # one adapter disk -> pinned host memory, allocating its pinned buffers
    adapter_bytes: int  # one adapter's weights (the copy budget counts bytes)
    source: dict[str, Any] = field(default_factory=dict)
    samples: tuple[StepSample, ...] = ()
    # (rank, seconds) of reads into reused pinned buffers, at one rank or more
    reused_reads: tuple[tuple[int, float], ...] = REUSED_READS

    def __post_init__(self) -> None:
        if min(self.copy_s, self.read_s) < 0 or self.adapter_bytes < 1:
            raise ValueError("copy and read times cannot be negative; adapters have bytes")
        if self.step.base_s <= 0 and self.step.per_seq_s <= 0:
            raise ValueError("a step must take some time")
        ranks = [rank for rank, _ in self.reused_reads]
        if not ranks or min(ranks) < 1 or len(set(ranks)) < len(ranks):
            raise ValueError(f"reused reads need distinct ranks of at least 1: {self.reused_reads}")
        if min(seconds for _, seconds in self.reused_reads) < 0:
            raise ValueError("read times cannot be negative")

    def step_s(self, seqs: int, adapters: int, prefill_tokens: int) -> float:
        return self.step.step_s(seqs, adapters, prefill_tokens)

    @property
    def rank(self) -> int:
        """The adapter rank the costs were measured with (16 when the source does not say)."""
        return int(self.source.get("rank", 16))

    @property
    def reuse_read_s(self) -> float:
        """A read into pinned buffers an evicted adapter gave back, at this rank: on the line
        through the recorded points either side of it (the nearest two beyond them, since a
        read has a part that does not grow with the rank); in proportion to the rank when one
        point is recorded."""
        points = sorted(self.reused_reads)
        if len(points) == 1:
            rank, seconds = points[0]
            return seconds * self.rank / rank
        i = next((i for i, (rank, _) in enumerate(points[1:-1], 1) if self.rank < rank), -1)
        (r0, s0), (r1, s1) = points[i - 1], points[i]
        return max(0.0, s0 + (s1 - s0) * (self.rank - r0) / (r1 - r0))

    def for_rank(self, rank: int) -> Calibration:
        """These costs for rank-`rank` adapters of the same projections: an adapter's bytes,
        its copy, its allocating read (pinning is per byte) and its share of a step's SGMV time
        grow with the rank; the base model's terms do not, and reads into reused buffers follow
        `reused_reads`. An estimate until a calibration at that rank is recorded."""
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
            reused_reads=self.reused_reads,
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
                reused_reads=tuple(
                    (int(rank), float(seconds))
                    for rank, seconds in data.get("reused_reads", REUSED_READS)
                ),
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
