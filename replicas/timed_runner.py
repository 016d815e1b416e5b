"""A model runner without a model: each step takes the time a calibrated GPU step would, and
samples deterministic tokens. The engine around it (scheduler, adapter manager, KV accounting)
and everything in front of it (Serve, ingress, streaming) are the real ones, so the served
path's host costs can be measured on a machine without a GPU (`benchmarks/bench_serve --timed`).

The step time follows the simulator's cost model (`replicas/step_cost.py`, fitted to steps
measured on a GPU by `python -m sim.calibrate`).

A step's host work (laying the batch out, the adapter manager's per-step work, taking in new
requests while it "runs") is done for real and overlaps the modelled device time, as it does
when the GPU replays a step. The launches a GPU step would make take the calibration's
`host_share` of the step, spent running Python (holding the GIL, handed over only at the
interpreter's switch interval, as launching code does); the thread then sleeps out the rest,
holding no lock and no GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from replicas.config import EngineConfig
from replicas.flat_step import lay_out
from replicas.kv_cache import blocks_for
from replicas.lora import LoraWeightPool
from replicas.models.spec import ModelSpec
from replicas.scheduler import ScheduledSeq
from replicas.step_cost import load_step_cost

POLL_S = 0.0002  # as HostStaging.readback: how often `while_running` runs during a step


class TimedRunner:
    """`ModelRunner`'s interface (`lora_pool`, `num_kv_blocks`, `dtype`, `execute`, `forget`,
    `last_launch_s`) on CPU, with no weights: adapter slots are real (small: the model's shapes
    from config.json) so that loads and evictions run as they do on a GPU."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, max_model_len: int) -> None:
        if config.device != "cpu":
            raise ValueError("timed steps stand in for a GPU on a CPU machine: device must be cpu")
        assert config.timed_steps is not None
        self.config = config
        self.spec = spec
        self.cost = load_step_cost(config.timed_steps)
        self.dtype = torch.float32
        self.lora_pool = LoraWeightPool(
            spec, config.max_loras_per_batch, config.max_lora_rank, self.dtype,
            torch.device("cpu"), backend="torch",
        )  # fmt: skip
        self.num_kv_blocks = config.num_kv_blocks or config.max_num_seqs * blocks_for(
            max_model_len, config.block_size
        )
        self.last_launch_s = 0.0
        # Sampled tokens: ids from the top half of the vocabulary (whole words for the
        # benchmarks' tokenizer), never an end-of-sequence id.
        eos = set(spec.eos_token_ids)
        self._tokens = [t for t in range(spec.vocab_size // 2, spec.vocab_size) if t not in eos]

    def forget(self, request_id: str) -> None:
        pass

    def execute(
        self,
        seqs: list[ScheduledSeq],
        layer_waits: object = None,
        while_running: Callable[[], bool] | None = None,
    ) -> list[int]:
        """As `ModelRunner.execute`: the sampled token of every seq whose `samples` is true, in
        the order of `seqs`, once the step's modelled time has passed since it started."""
        started = time.monotonic()
        order, step = lay_out(seqs, self.config.block_size)
        prefill = sum(s.num_new_tokens for s in seqs if s.num_new_tokens > 1)
        done_at = started + self.cost.step_s(len(seqs), len(set(step.seg_slots)), prefill)
        tokens = [self._token(s) for s in seqs if s.samples]
        _run_python_until(started + self.cost.host_share * (done_at - started))
        self.last_launch_s = time.monotonic() - started
        if while_running is not None and while_running():
            while (left := done_at - time.monotonic()) > 0:
                time.sleep(min(POLL_S, left))
                if not while_running():
                    break
        left = done_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        return tokens

    def _token(self, seq: ScheduledSeq) -> int:
        req = seq.request
        k = req.num_prompt_tokens * 131 + len(req.output_token_ids) * 17
        return self._tokens[k % len(self._tokens)]


def _run_python_until(deadline: float) -> None:
    """Busy with bytecode until `deadline` (monotonic): the GIL is held as launching kernels
    holds it, so other threads of the process get it only at switch intervals."""
    while time.monotonic() < deadline:
        pass
