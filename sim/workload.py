"""Request streams for the simulator: a routing cell's own (the same seeded requests and arrival
times `benchmarks/bench_router_serve.py` sends, from `workloads/`), a one-adapter
`benchmarks/bench_serve.py` run's, or generated ones for policy studies.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

# One request after another: how loadgen's `warm_up` burst ("all at once": `asyncio.gather`
# over the list) reaches an HTTP server. `python -m sim.burst` sent a cell's warm-up to a local
# uvicorn server in a process of its own: 64 requests arrived over 4-47 ms (median 18 ms, 25
# bursts), 256 over 36-148 ms (median 102 ms, 5 bursts), in the order sent or partly reordered,
# never at one instant. Serve's proxy and the ingresses only add time. The predictions do not
# hang on the gap: the same loads for an easy cell's 64 over 5 ms to 0.2 s, and for
# placement-4x affinity's 256 at 0.1 to 1 ms a request (docs/perf/routing_sim.md).
BURST_GAP_S = 0.00035


@dataclass(frozen=True)
class Arrival:
    """One request: when the client sends it (seconds), its adapter (None: the base model),
    prompt and output tokens."""

    t: float
    adapter: str | None
    prompt: int
    output: int

    def __post_init__(self) -> None:
        if self.t < 0 or self.prompt < 1 or self.output < 1:
            raise ValueError(f"bad arrival {self}")


@dataclass(frozen=True)
class Workload:
    """`warmup` runs first and is not measured. With `gap_s`, `measured` times count from
    `gap_s` after the last warm-up request finished (the serving benchmark's warm-up, pause,
    run); with None they are absolute, one continuous stream whose measured part starts at
    its first arrival."""

    warmup: tuple[Arrival, ...]
    measured: tuple[Arrival, ...]
    gap_s: float | None = 1.0
    name: str = ""
    digest: str = ""  # loadgen's workload_digest of the measured requests, when built from it

    def __post_init__(self) -> None:
        if not self.measured:
            raise ValueError("a workload needs measured requests")
        for part in (self.warmup, self.measured):
            if any(a.t > b.t for a, b in itertools.pairwise(part)):
                raise ValueError("arrivals must be in time order")


def serving_benchmark(
    *,
    num_adapters: int,
    slots: int,
    replicas: int,
    rate: float,
    num_requests: int,
    popularity: str,
    input_len: tuple[int, int] = (128, 512),
    output_len: tuple[int, int] = (32, 96),
    seed: int = 0,
) -> Workload:
    """The requests of one routing cell as `benchmarks/bench_router_serve.py` sends them
    (`workloads.router_cell`): a warm-up over every adapter in turn, all at once with short
    outputs (a burst, in the order sent, `BURST_GAP_S` apart), then the seeded workload at
    Poisson `rate`."""
    from workloads.arrivals import arrival_offsets
    from workloads.requests import LengthRange, rng_for, workload_digest
    from workloads.router_cell import adapter_names, cell_requests

    cell = cell_requests(
        adapter_names(num_adapters),
        slots=slots,
        replicas=replicas,
        num_requests=num_requests,
        popularity=popularity,
        input_len=LengthRange(*input_len),
        output_len=LengthRange(*output_len),
        seed=seed,
    )
    warm, measured = cell.warmup, cell.measured
    # runner.run_load: Poisson (burstiness 1) offsets from the load's seed
    offsets = arrival_offsets(len(measured), rate, 1.0, rng_for(seed, "arrivals"))

    def arrival(t: float, spec) -> Arrival:
        adapter = None if spec.is_base else spec.model
        return Arrival(float(t), adapter, spec.input_len, spec.output_len)

    return Workload(
        warmup=tuple(arrival(i * BURST_GAP_S, s) for i, s in enumerate(warm)),
        measured=tuple(arrival(t, s) for t, s in zip(offsets, measured, strict=True)),
        gap_s=1.0,  # measure(): `asyncio.sleep(1.0)` after the warm-up
        name=popularity,
        digest=workload_digest(measured),
    )


def one_adapter_serving(
    *,
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    rate: float,
    max_num_seqs: int,
    seed: int = 0,
    adapter: str = "lora-0",
) -> Workload:
    """The requests of a one-adapter `benchmarks/bench_serve.py` run (`--workload seeds`), as
    its in-process engine gets them: a warm-up burst of `max_num_seqs` requests with 8-token
    outputs, then, once it has finished, the seeded stream at Poisson `rate`
    (`serve_workloads.streams` and `warmup_specs` on one replica)."""
    from workloads.arrivals import arrival_offsets
    from workloads.requests import (
        LengthRange,
        WorkloadConfig,
        build_workload,
        rng_for,
        workload_digest,
    )

    def specs(popularity: str, count: int, seed_: int, out: LengthRange):
        return build_workload(
            WorkloadConfig(
                num_prompts=count,
                input_len=LengthRange(*input_len),
                output_len=out,
                adapters=(adapter,),
                base_model="base",
                popularity=popularity,
                seed=seed_,
            )
        )

    short = min(8, output_len[1])
    warm = specs("distinct", min(num_requests, max_num_seqs), seed + 1, LengthRange(short, short))
    measured = specs("uniform", num_requests, seed, LengthRange(*output_len))
    offsets = arrival_offsets(num_requests, rate, 1.0, rng_for(seed, "arrivals"))
    return Workload(
        warmup=tuple(Arrival(0.0, adapter, s.input_len, s.output_len) for s in warm),
        measured=tuple(
            Arrival(float(t), adapter, s.input_len, s.output_len)
            for t, s in zip(offsets, measured, strict=True)
        ),
        gap_s=0.0,
        name="one adapter",
        digest=workload_digest(measured),
    )


@dataclass(frozen=True)
class Generated:
    """A generated stream. kind: "uniform", "zipf" (rank i drawn with weight 1/i^alpha),
    "skewed" (weight alpha^i), or "bursty" (`phases` spans, each a Zipf(alpha) over a fresh
    ranking, the rate alternating x(1 - burst) and x(1 + burst)). Popularity is not tied to
    names (a shuffled ranking), so neither to their hashes."""

    kind: str = "zipf"
    alpha: float = 1.0
    num_adapters: int = 64
    num_requests: int = 2000
    rate: float = 10.0
    prompt: tuple[int, int] = (128, 512)
    output: tuple[int, int] = (32, 96)
    phases: int = 4
    burst: float = 0.25
    base_fraction: float = 0.0
    warmup_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "zipf", "skewed", "bursty"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
        if self.kind == "skewed" and not 0 < self.alpha <= 1:
            raise ValueError("a geometric (skewed) workload needs alpha in (0, 1]")
        if not 0 <= self.burst < 1 or not 0 <= self.warmup_fraction < 1:
            raise ValueError("burst and warmup_fraction must be in [0, 1)")

    @property
    def name(self) -> str:
        return "uniform" if self.kind == "uniform" else f"{self.kind}{self.alpha:g}"

    def build(self) -> Workload:
        rng = random.Random(self.seed)
        names = [f"adapter-{i:04d}" for i in range(self.num_adapters)]
        phases = self.phases if self.kind == "bursty" else 1
        per_phase = math.ceil(self.num_requests / phases)
        out: list[Arrival] = []
        t = 0.0
        for phase in range(phases):
            order = names[:]
            rng.shuffle(order)
            if self.kind == "uniform":
                weights = [1.0] * len(order)
            elif self.kind == "skewed":
                weights = [self.alpha**i for i in range(len(order))]
            else:
                weights = [1.0 / (i + 1) ** self.alpha for i in range(len(order))]
            rate = self.rate
            if self.kind == "bursty":
                rate *= 1 - self.burst if phase % 2 == 0 else 1 + self.burst
            count = min(per_phase, self.num_requests - len(out))
            for adapter in rng.choices(order, weights=weights, k=count):
                t += rng.expovariate(rate)
                pick: str | None = adapter
                if self.base_fraction and rng.random() < self.base_fraction:
                    pick = None
                out.append(Arrival(t, pick, rng.randint(*self.prompt), rng.randint(*self.output)))
        split = int(self.warmup_fraction * len(out))
        return Workload(tuple(out[:split]), tuple(out[split:]), gap_s=None, name=self.name)
