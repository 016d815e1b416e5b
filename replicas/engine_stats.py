"""What the engine reports about itself: frozen snapshots, read between steps.

`EngineStats` feeds metrics and benchmarks, `RoutingStats` the router; `StepTiming` is one
step's time split, kept for the most recent steps (`Engine.step_timings`). Field names are the
keys of the JSON the deployment returns (`EngineDeployment.stats`, `record_routing_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went, for benchmarks that need to tell host from device."""

    num_tokens: int  # tokens computed (more than num_seqs: the step has prefill)
    num_seqs: int
    gated: bool  # the step's layers waited on an adapter copy (on the load stream, or queued
    # ahead of them on the compute stream by a blocking load)
    launch_s: float  # host: from the step's start to its last launch
    total_s: float  # host: from the step's start until its sampled tokens were back
    started: float = 0.0  # time.monotonic() at the step's start (one clock for a host's processes)


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_preemptions: int  # running requests sent back to wait (KV cache full), recomputed
    max_adapters_in_step: int  # the most distinct adapters one step has batched
    adapter_disk_reads: int  # disk -> host memory
    adapter_gpu_loads: int  # host memory -> GPU slot
    adapter_prefetch_loads: int  # GPU loads the prefetcher started ahead of admission
    adapter_hits: int  # admissions that found their adapter in a slot
    adapter_misses: int  # admissions that had to bring it in
    adapter_read_seconds: tuple[float, ...]  # the latest disk reads' latencies, one per read
    resident_adapters: dict[str, int]  # adapter -> GPU slot (loaded or loading)
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_running: int
    num_waiting: int
    busy_s: float = 0.0  # time inside steps (start -> sampled tokens back): the device's busy time
    launch_s: float = 0.0  # of which host time from a step's start to its last launch, summed
    step_seqs: int = 0  # sequences over all steps (over num_steps: the mean batch)
    num_finished: int = 0  # requests finished (stopped or at their length), aborts not counted


@dataclass(frozen=True)
class RoutingStats:
    """What the router places requests by (router/policy.py `ReplicaView`)."""

    gpu: tuple[str, ...]  # adapters in a GPU slot, copy landed
    loading: tuple[str, ...]  # disk read or host->GPU copy in flight
    host: tuple[str, ...]  # in host memory only
    num_slots: int
    free_slots: int
    num_waiting: int
    num_running: int
