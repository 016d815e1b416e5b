"""The requests of one routing cell: a warm-up over every adapter in turn, then the seeded run.

`benchmarks/bench_router_serve.py` sends them through HTTP and `sim/workload.py` replays them in
the fleet simulator, so a measurement and its prediction see the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.requests import LengthRange, RequestSpec, WorkloadConfig, build_workload

BASE_MODEL = "base"  # the served name of the base model
WARMUP_OUTPUT_LEN = 8  # tokens a warm-up request asks for (fewer if the run's outputs are shorter)


def adapter_names(count: int) -> list[str]:
    """The cell's adapters, most popular first under skewed, zipf and hot."""
    return [f"lora-{i}" for i in range(count)]


@dataclass(frozen=True)
class CellRequests:
    warmup: list[RequestSpec]  # every adapter in turn, sent all at once, not measured
    measured: list[RequestSpec]


def cell_requests(
    names: list[str] | tuple[str, ...],
    *,
    slots: int,
    replicas: int,
    num_requests: int,
    popularity: str,
    input_len: LengthRange,
    output_len: LengthRange,
    seed: int,
) -> CellRequests:
    """The warm-up goes over the adapters in turn with short outputs (at most four slots' worth
    per replica): batches of many adapters and prompts of every length on each replica before
    anything is timed. The measured requests draw their adapters by `popularity` from `seed`."""

    def specs(kind: str, count: int, seed_: int, out: LengthRange) -> list[RequestSpec]:
        return build_workload(
            WorkloadConfig(
                num_prompts=count,
                input_len=input_len,
                output_len=out,
                adapters=tuple(names),
                base_model=BASE_MODEL,
                popularity=kind,
                seed=seed_,
            )
        )

    warm_count = min(len(names), max(2, 4 * slots * replicas))
    short = min(WARMUP_OUTPUT_LEN, output_len.high)
    return CellRequests(
        warmup=specs("distinct", warm_count, seed + 1, LengthRange(short, short)),
        measured=specs(popularity, num_requests, seed, output_len),
    )
