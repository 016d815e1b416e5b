"""Where a small batch's SGMV layer spends its time: the programs of its eight kernels on one
clock, under CUDA-graph replay (GPU).

    python -m benchmarks.bench_sgmv_timeline [--cases 1:1:16,8:8:16] [--reps 20] [--out DIR]

A case is tokens:adapters:rank (Llama-3-8B shapes, bf16, as `bench_sgmv`). Every program of every
launch records the global timer at its start, once its item was located (the segment and slot
tables read), once its `gdc_wait` returned (the kernel before it finished) and at its end
(`kernels/sgmv_triton.py` `record_timeline`). The graph runs enough layers to overflow L2, twice
back to back; the table is one layer from the middle of the second run, medians over `--reps`
replays, in µs from the end of the layer before:

- start: the first and the last program started;
- located: the last program located its item; waited: the first and last `gdc_wait` returned;
- end: the last program ended (the kernel's end, up to its stores' completion);
- release: the first wait's return after the kernel before ended (the chain's own latency);
- after_wait: a program's median time from its wait's return to its end (its x or h and y
  reads, its product and its stores).

The comparison it exists for: each kernel's release and after-wait time against the layer's
span, and the span against the same graph timed without timestamps (their perturbation).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

FIELDS = ("start", "located", "waited", "end", "sm")
START, LOCATED, WAITED, END = range(4)
KERNELS_PER_GROUP = ("shrink", "expand")


@dataclass(frozen=True)
class KernelSpan:
    """One launch's programs on the layer's clock (µs; None where no program recorded it)."""

    programs: int
    with_item: int
    start_first: float
    start_last: float
    located_last: float | None
    waited_first: float | None
    waited_last: float | None
    end_last: float
    release: float | None
    after_wait: float | None


def layer_origin(records: list[list[list[int]]], grids: list[int], first: int) -> int:
    """The layer's clock origin (ns): the last end stamp of launch first - 1."""
    return max(r[END] for r in records[first - 1][:grids[first - 1]] if r[END])


def kernel_spans(records: list[list[list[int]]], grids: list[int], first: int, count: int
                 ) -> list[KernelSpan]:
    """Launches [first, first + count) of one replay's `records` ([launch][program][field], ns;
    0 = not recorded) as spans in µs from the end of launch first - 1 (the launch before them,
    whose end the first one waits for)."""
    if first < 1:
        raise ValueError("the first launch needs a launch before it on the clock")

    origin = layer_origin(records, grids, first)

    def at(program: list[int], field: int) -> float | None:
        return (program[field] - origin) / 1e3 if program[field] else None

    spans = []
    prev_end = 0.0
    for launch in range(first, first + count):
        programs = records[launch][:grids[launch]]
        starts = [at(p, START) for p in programs]
        located = [v for p in programs if (v := at(p, LOCATED)) is not None]
        waited = [v for p in programs if (v := at(p, WAITED)) is not None]
        end = max(at(p, END) for p in programs)
        after = [(p[END] - p[WAITED]) / 1e3 for p in programs if p[WAITED] and p[END]]
        spans.append(KernelSpan(
            programs=len(programs),
            with_item=len(waited),
            start_first=min(starts),
            start_last=max(starts),
            located_last=max(located) if located else None,
            waited_first=min(waited) if waited else None,
            waited_last=max(waited) if waited else None,
            end_last=end,
            release=min(waited) - prev_end if waited else None,
            after_wait=statistics.median(after) if after else None,
        ))
        prev_end = end
    return spans


def median_spans(replays: list[list[KernelSpan]]) -> list[dict]:
    """Per kernel, the median of each field over replays (fields missing in a replay skipped)."""
    out = []
    for k in range(len(replays[0])):
        row = {}
        for name in KernelSpan.__dataclass_fields__:
            values = [getattr(r[k], name) for r in replays if getattr(r[k], name) is not None]
            row[name] = statistics.median(values) if values else None
        out.append(row)
    return out


def timer_step_ns(records: list[list[list[int]]], grids: list[int]) -> int:
    """The smallest positive difference between start stamps of one launch: the timer's
    resolution, or an upper bound on it."""
    best = None
    for launch, grid in enumerate(grids):
        starts = sorted({r[START] for r in records[launch][:grid] if r[START]})
        for a, b in zip(starts, starts[1:], strict=False):
            best = b - a if best is None else min(best, b - a)
    return best or 0


def parse_cases(spec: str) -> list:
    from benchmarks.bench_sgmv import MIXED_RANKS, Case

    out = []
    for item in spec.split(","):
        tokens, adapters, rank = item.split(":")
        b, d = int(tokens), int(adapters)
        if b % d:
            raise SystemExit(f"{item}: tokens must split evenly over adapters")
        ranks = (tuple(MIXED_RANKS[i % 4] for i in range(d)) if rank == "mixed"
                 else (int(rank),) * d)
        out.append(Case("decode", (b // d,) * d, ranks, rank))
    return out


def layer_programs(records: list[list[list[int]]], grids: list[int], first: int,
                   count: int) -> list[list[list[float | int]]]:
    """Every program of launches [first - 1, first + count) as [start, located, waited, end]
    in µs from the end of launch first - 1 (None where not recorded) and its SM: where each
    program ran and when, for looking at one layer's programs side by side."""
    origin = layer_origin(records, grids, first)
    return [[[(p[f] - origin) / 1e3 if p[f] else None for f in (START, LOCATED, WAITED, END)]
             + [p[4]] for p in records[launch][:grids[launch]]]
            for launch in range(first - 1, first + count)]


def measure(case, reps: int) -> tuple[list[dict], dict]:
    from benchmarks.bench_sgmv import (
        LLAMA3_8B,
        graph_us_per_layer,
        layers_for,
        make_problem,
        sgmv_layer,
    )
    from benchmarks.common import time_cuda
    from kernels.sgmv_triton import Timeline, record_timeline

    device = torch.device("cuda")
    layers = layers_for(case, LLAMA3_8B, device)
    p = make_problem(case, LLAMA3_8B, layers, torch.bfloat16, device)
    untraced_us = graph_us_per_layer(p, sgmv_layer)
    per_layer = 2 * len(LLAMA3_8B)
    props = torch.cuda.get_device_properties(device)
    timeline = Timeline(layers * per_layer, props.multi_processor_count * 32, device)

    def step():
        for layer in range(layers):
            sgmv_layer(p, layer)

    with record_timeline(timeline):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles the traced kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        timeline.grids.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    traced_us = time_cuda(graph.replay, iters=20, repeats=7, warmup=3) / layers
    middle = layers // 2 * per_layer
    replays, step_ns = [], []
    for _ in range(reps):
        timeline.records.zero_()
        graph.replay()
        graph.replay()  # the second replay follows the first as a layer follows the one before
        torch.cuda.synchronize()
        records = timeline.records.tolist()
        replays.append(kernel_spans(records, timeline.grids, middle, per_layer))
        step_ns.append(timer_step_ns(records, timeline.grids[middle:middle + per_layer]))
    programs = layer_programs(records, timeline.grids, middle, per_layer)  # the last replay's
    rows = median_spans(replays)
    names = [f"{g} {k}" for g in LLAMA3_8B for k in KERNELS_PER_GROUP]
    label = f"{case.num_tokens} over {case.num_adapters}, rank {case.rank_label}"
    for name, row in zip(names, rows, strict=True):
        row.update(case=label, kernel=name)
    summary = {"case": label, "layers": layers, "untraced_us": untraced_us,
               "traced_us": traced_us, "span_us": rows[-1]["end_last"],
               "timer_step_ns": min(step_ns), "programs": programs}
    del graph
    return rows, summary


def run_gpu(args: argparse.Namespace) -> None:
    from benchmarks.common import write_results

    torch.manual_seed(0)
    rows, summaries, programs = [], [], {}
    for case in parse_cases(args.cases):
        case_rows, summary = measure(case, args.reps)
        rows += case_rows
        programs[summary["case"]] = summary.pop("programs")
        summaries.append(summary)
        print(summary, flush=True)
        for row in case_rows:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
    path = write_results(
        args.out,
        "sgmv_timeline",
        "SGMV layer timeline: one layer's eight kernels on one clock, bf16, CUDA-graph replay",
        "µs from the end of the layer before; release = first wait returned - the kernel "
        "before ended; after_wait = median of a program's end - its wait; span = the layer's "
        "last end, against untraced_us, the same graph without timestamps",
        ["case", "kernel", "programs", "with_item", "start_first", "start_last", "located_last",
         "waited_first", "waited_last", "end_last", "release", "after_wait"],
        rows,
        {"layers": summaries},
    )
    if args.programs:  # the last replay's programs, launch by launch (the layer before first)
        Path(args.programs).write_text(json.dumps(programs) + "\n")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1:1:16,1:1:64,8:1:16,8:8:16,8:8:8,8:1:64",
                    help="tokens:adapters:rank, comma-separated (rank: a number or mixed)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--programs", default=None,
                    help="also write every program of the layer (times, SM) to this JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the timestamps are read off the device's timer)")
    run_gpu(args)


if __name__ == "__main__":
    main()
