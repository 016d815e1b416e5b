"""Measure what the simulator's replicas cost, with the real engine, and write the calibration.

    python -m sim.calibrate --out benchmarks/results/sim_calibration.json       # CUDA
    python -m sim.calibrate --smoke --out /tmp/sim_calibration.json             # CPU, tiny

The engine is benchmarks/bench_churn.py's: a Llama-3-8B-shaped model of random weights
(`load_format: dummy`), rank-`--rank` adapters over all seven projections in PEFT files, 8 GPU
slots, prefetch loading. Measured:
- disk reads: `preload_adapter` of distinct adapters, the engine's own read latencies
  (`EngineStats.adapter_read_seconds`);
- one host->GPU adapter copy: the slot pool's write on a side stream (`copy_bandwidth`,
  which bench_churn reports too; on CPU, the write itself);
- steps: batches of `--batches` sequences over `--adapters` distinct adapters, all resident,
  decoding (`Engine.step_timings`, steps with one token per sequence), and single prompts of
  `--prefills` tokens, each run once before it is measured on CUDA (kernels compile, graphs
  are captured); the step cost model is fitted to them (sim/calibration.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sim.calibration import Calibration, StepCost, StepSample


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_engine(root: Path, *, smoke: bool, rank: int, num_adapters: int, slots: int):
    """bench_churn's engine: model folder, adapter files, EngineConfig."""
    import torch

    from replicas.config import EngineConfig
    from replicas.engine import Engine
    from replicas.models.spec import ModelSpec
    from synthetic.adapters import write_fleet
    from synthetic.presets import LLAMA3_8B, TINY

    model_config = TINY if smoke else LLAMA3_8B
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps(model_config))
    spec = ModelSpec.from_dir(root / "model")
    names = [f"lora-{i}" for i in range(num_adapters)]
    fleet = write_fleet(root, spec, names, rank)
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    engine = Engine(
        EngineConfig(
            model=str(root / "model"),
            load_format="dummy",
            device=device,
            max_loras_per_batch=slots,
            max_lora_rank=rank,
            max_loaded_loras=num_adapters,
            adapters=tuple(fleet.items()),
            adapter_loading="prefetch",
            num_kv_blocks=512 if device == "cpu" else 4096,
            max_num_seqs=64,
            max_model_len=2048,
        )
    )
    return engine, names, device, model_config


def measure_reads(engine, names: list[str]) -> list[float]:
    """Seconds per disk read, one per adapter in `names` (not yet read)."""
    before = len(engine.stats().adapter_read_seconds)
    for name in names:
        engine.preload_adapter(name)
    return list(engine.stats().adapter_read_seconds[before:])


def measure_copy(engine, name: str, device: str) -> tuple[float, int]:
    """Seconds of one adapter's host->GPU write, and its bytes."""
    weights = engine.adapters.host.peek(name)
    if device == "cuda":
        return copy_bandwidth(engine, name)["write_ms"] / 1e3, weights.nbytes
    pool = engine.runner.lora_pool
    slot = pool.num_slots - 1
    pool.write(slot, weights)
    reps = 5
    start = time.perf_counter()
    for _ in range(reps):
        pool.write(slot, weights)
    return (time.perf_counter() - start) / reps, weights.nbytes


def copy_bandwidth(engine, adapter: str) -> dict:
    """Host->GPU adapter write on the load stream vs a plain pinned copy of the same bytes."""
    import torch

    engine.preload_adapter(adapter)
    weights = engine.adapters.host.peek(adapter)
    pool = engine.runner.lora_pool
    stream = torch.cuda.Stream()
    slot = pool.num_slots - 1
    for _ in range(2):
        pool.write(slot, weights, stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        events = pool.write(slot, weights, stream)
    events[-1].synchronize()
    write_s = (time.perf_counter() - t0) / reps
    src = torch.empty(weights.nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(weights.nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    plain_s = (time.perf_counter() - t0) / reps
    return {
        "adapter_MB": weights.nbytes / 1e6,
        "write_GBps": weights.nbytes / write_s / 1e9,
        "pinned_copy_GBps": weights.nbytes / plain_s / 1e9,
        "ratio": plain_s / write_s,
        # one adapter's write: a request whose adapter is cold on arrival, with no hint ahead of
        # it, waits at least this long for its first token under any loading scheme
        "write_ms": write_s * 1e3,
    }


def _run(engine, requests) -> list:
    """Add `requests`, step until they finish; the timings of the steps run."""
    since = engine.num_steps
    for request in requests:
        engine.add_request(request)
    while engine.has_work:
        engine.step()
    return engine.step_timings(since)


def measure_steps(
    engine,
    names: list[str],
    batches: list[int],
    adapters: list[int],
    prefills: list[int],
    *,
    decode_steps: int = 8,
    warm: bool = True,
) -> list[StepSample]:
    """Decode steps of every (batch, adapters) pair and single prefills; with `warm`, each is
    run twice and the second kept (the first compiles kernels and captures graphs)."""
    from replicas.request import Request, SamplingParams

    for name in names[: max(adapters)]:
        engine.preload_adapter(name, into_slot=True)
    samples: list[StepSample] = []
    count = 0

    def request(adapter: str, prompt: int, max_tokens: int) -> Request:
        nonlocal count
        count += 1
        return Request(
            f"cal-{count}",
            [2 + (i % 200) for i in range(prompt)],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            adapter=adapter,
        )

    runs = (False, True) if warm else (True,)
    for b in batches:
        for k in adapters:
            if k > b:
                continue
            for keep in runs:
                reqs = [request(names[i % k], 16, decode_steps + 1) for i in range(b)]
                timings = _run(engine, reqs)
                if keep:
                    samples += [
                        StepSample(b, k, 0, t.total_s)
                        for t in timings
                        if t.num_tokens == t.num_seqs == b
                    ]
    for n in prefills:
        for keep in runs:
            timings = _run(engine, [request(names[0], n, 1)])
            if keep:
                samples += [
                    StepSample(1, 1, t.num_tokens, t.total_s)
                    for t in timings
                    if t.num_tokens > t.num_seqs
                ]
    return samples


def calibrate(args: argparse.Namespace) -> Calibration:
    import torch

    root = Path(tempfile.mkdtemp(prefix="sim-calibrate-"))
    slots = max(args.adapters)
    num_adapters = slots + args.reads
    engine, names, device, model_config = build_engine(
        root, smoke=args.smoke, rank=args.rank, num_adapters=num_adapters, slots=slots
    )
    try:
        reads = measure_reads(engine, names[slots:])
        steps = measure_steps(
            engine,
            names,
            args.batches,
            args.adapters,
            args.prefills,
            decode_steps=args.decode_steps,
            warm=device == "cuda",
        )
        copy_s, nbytes = measure_copy(engine, names[0], device)
    finally:
        engine.shutdown()
    return Calibration(
        step=StepCost.fit(steps),
        copy_s=copy_s,
        read_s=statistics.median(reads),
        adapter_bytes=nbytes,
        source={
            "command": "python -m sim.calibrate " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "model": "tiny (smoke)" if args.smoke else "Llama-3-8B-shaped (load_format dummy)",
            "hidden_size": model_config["hidden_size"],
            "rank": args.rank,
            "reads_s": reads,
        },
        samples=tuple(steps),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/sim_calibration.json")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batches", type=_ints, default=[1, 8, 16, 32, 64])
    ap.add_argument("--adapters", type=_ints, default=[1, 4, 8])
    ap.add_argument("--prefills", type=_ints, default=[128, 256, 512, 1024])
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per batch")
    ap.add_argument("--reads", type=int, default=6, help="disk reads to time")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    args = ap.parse_args(argv)
    cal = calibrate(args)
    cal.save(args.out)
    s = cal.step
    print(
        f"step = {s.base_s * 1e3:.3f} ms + {s.per_seq_s * 1e3:.4f} ms/seq + "
        f"{s.per_adapter_s * 1e3:.4f} ms/adapter + {s.prefill_token_s * 1e6:.2f} us/prefill "
        f"token; copy {cal.copy_s * 1e3:.3f} ms; read {cal.read_s * 1e3:.2f} ms "
        f"({len(cal.samples)} step samples) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
