"""The benchmark's named workloads and the request streams they make: a model shape with dummy
weights, rank-r adapters, seeded prompts of token ids with exact output lengths, and their
arrivals (`Stream.offsets()` are the send times `loadgen.run_load` uses, so every path sees the
same requests at the same times)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loadgen import LengthRange, LoadConfig, RequestSpec, WorkloadConfig, build_workload
from synthetic.presets import LLAMA3_8B, TINY
from workloads.arrivals import arrival_offsets
from workloads.requests import rng_for

BASE_MODEL = "base"
WARMUP_OUTPUT_TOKENS = 8
LLAMA31_8B = {
    **LLAMA3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@dataclass(frozen=True)
class Workload:
    """A named workload: the model, the adapters, the requests and how they arrive. Each count
    in `adapter_counts` is a stream of its own over the same prompts and lengths."""

    name: str
    shape: str  # the model's name, for the results
    model: Mapping[str, Any]  # config.json of a Llama-shaped model (weights: dummy)
    adapter_counts: tuple[int, ...]
    rank: int
    slots: int  # max_loras_per_batch
    num_requests: int
    input_len: LengthRange
    output_len: LengthRange
    rate: float  # requests/s, Poisson; inf: all at once
    max_num_seqs: int
    max_model_len: int
    sweep_steps: int = 0  # > 0: a goodput sweep of this many bisection steps
    published: tuple[str, dict[str, float]] | None = None  # source, {figure: value}

    @property
    def num_adapters(self) -> int:
        return max(self.adapter_counts)


def _range(text: str) -> LengthRange:
    return LengthRange.parse(text)


SATURATED = Workload(
    name="saturated", shape="Llama-3-8B", model=LLAMA3_8B, adapter_counts=(32, 1), rank=16,
    slots=32, num_requests=512, input_len=_range("128:512"), output_len=_range("128"),
    rate=math.inf, max_num_seqs=128, max_model_len=1024,
)  # fmt: skip
WORKLOADS = {
    "saturated": SATURATED,
    "poisson": replace(
        SATURATED, name="poisson", adapter_counts=(32,), num_requests=160, sweep_steps=3
    ),
    "seeds": Workload(
        name="seeds", shape="Llama-3.1-8B", model=LLAMA31_8B, adapter_counts=(1,), rank=16,
        slots=1, num_requests=480, input_len=_range("200:1000"), output_len=_range("100:400"),
        rate=8.0, max_num_seqs=128, max_model_len=2048,
        published=("SGLang", {"ttft_p50_ms": 62.65, "itl_p50_ms": 22.68}),
    ),
}  # fmt: skip
# `--smoke`: the same code on CPU with a tiny model and a handful of requests.
TINY_SIZES = dict(shape="tiny", model=TINY, rank=4, max_num_seqs=8, max_model_len=128)
SMOKE = {
    "saturated": replace(
        SATURATED, **TINY_SIZES, adapter_counts=(4, 1), slots=4, num_requests=12,
        input_len=_range("8:32"), output_len=_range("8"),
    ),
    "poisson": replace(
        WORKLOADS["poisson"], **TINY_SIZES, adapter_counts=(4,), slots=4, num_requests=8,
        input_len=_range("8:32"), output_len=_range("8"), sweep_steps=1,
    ),
    "seeds": replace(
        WORKLOADS["seeds"], **TINY_SIZES, num_requests=12, input_len=_range("16:48"),
        output_len=_range("4:12"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Stream:
    """The requests of one measured run and how they arrive: `offsets()` are the send times
    `run_load` uses for `load` (same generator, same seed), so HTTP and in-process see the same
    arrivals."""

    label: str
    specs: list[RequestSpec]
    load: LoadConfig

    def offsets(self) -> np.ndarray:
        return arrival_offsets(
            len(self.specs),
            self.load.request_rate,
            self.load.burstiness,
            rng_for(self.load.seed, "arrivals"),
        )

    def at(self, rate: float) -> Stream:
        return Stream(self.label, self.specs, replace(self.load, request_rate=rate))


def adapters_label(count: int) -> str:
    return f"{count} adapter" + ("s" if count != 1 else "")


def streams(wl: Workload, names: Sequence[str], seed: int, timeout_s: float) -> list[Stream]:
    """One stream per adapter count: the same prompts and lengths (loadgen draws them from
    generators of their own), adapters picked uniformly among the first `count` names."""
    out = []
    for count in wl.adapter_counts:
        specs = build_workload(
            WorkloadConfig(
                num_prompts=wl.num_requests,
                input_len=wl.input_len,
                output_len=wl.output_len,
                adapters=tuple(names[:count]),
                base_model=BASE_MODEL,
                popularity="uniform",
                seed=seed,
            )
        )
        load = LoadConfig(request_rate=wl.rate, timeout_s=timeout_s, seed=seed)
        out.append(Stream(adapters_label(count), specs, load))
    return out


def warmup_specs(wl: Workload, names: Sequence[str], replicas: int, seed: int) -> list[RequestSpec]:
    """A burst over every adapter in turn with short outputs: full batches, every prompt length
    and every slot in use on each replica before anything is timed."""
    count = min(wl.num_requests, max(wl.num_adapters, wl.max_num_seqs)) * replicas
    short = min(WARMUP_OUTPUT_TOKENS, wl.output_len.high)
    return build_workload(
        WorkloadConfig(
            num_prompts=max(count, 2),
            input_len=wl.input_len,
            output_len=LengthRange(short, short),
            adapters=tuple(names),
            base_model=BASE_MODEL,
            popularity="distinct",
            seed=seed + 1,
        )
    )


def describe(wl: Workload) -> dict[str, Any]:
    return {
        "name": wl.name,
        "model": f"{wl.shape} shape, load_format dummy",
        "adapters": f"{'/'.join(map(str, wl.adapter_counts))} of rank {wl.rank}, {wl.slots} slots",
        "requests": wl.num_requests,
        "prompts": str(wl.input_len),
        "outputs": str(wl.output_len),
        "rate": "all at once" if math.isinf(wl.rate) else wl.rate,
        "max_num_seqs": wl.max_num_seqs,
    }
