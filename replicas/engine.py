"""The engine: requests in, tokens out, one `step()` at a time. No threads, no Ray.

step = schedule -> run the model -> postprocess (append tokens, finish requests)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from replicas.adapters.loader import AdapterError
from replicas.adapters.manager import AdapterManager
from replicas.config import EngineConfig
from replicas.kv_cache import BlockAllocator
from replicas.model_runner import ModelRunner
from replicas.models.spec import ModelSpec
from replicas.request import Request, RequestOutput, RequestStatus
from replicas.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)
STEP_LOG = 1 << 14  # step timings kept (the most recent)


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went, for benchmarks that need to tell host from device."""

    num_tokens: int  # tokens computed (more than num_seqs: the step has prefill)
    num_seqs: int
    gated: bool  # the step's layers waited on an adapter copy (on the load stream, or queued
    # ahead of them on the compute stream by a blocking load)
    launch_s: float  # host: from the step's start to its last launch
    total_s: float  # host: from the step's start until its sampled tokens were back


class RequestRejected(ValueError):
    """A request the engine refuses before queueing it. `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = ModelSpec.from_dir(config.model)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
        )
        self.eos_token_ids = frozenset(self.spec.eos_token_ids + config.eos_token_ids)
        self.runner = ModelRunner(config, self.spec, self.max_model_len)
        self.adapters = AdapterManager(
            self.spec,
            self.runner.lora_pool,
            config.max_lora_rank,
            config.adapter_paths,
            config.adapter_root,
            config.max_loaded_loras,
            self.runner.dtype,
            mode=config.adapter_loading,
            eviction_policy=config.eviction_policy,
            max_loaded_bytes=config.max_loaded_lora_bytes,
            pinned=config.pinned_adapters,
        )
        self.blocks = BlockAllocator(self.runner.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                kv_reserve_ratio=config.kv_reserve_ratio,
                min_kv_reserve_ratio=0.1 * config.kv_reserve_ratio,
            ),
            self.blocks,
            self.adapters,
        )
        self.num_steps = 0
        self.num_preemptions = 0  # running requests sent back to wait (KV cache full), recomputed
        self.stalled = False  # the last step ran nothing while requests wait (adapter reads)
        self.max_adapters_in_step = 0  # the most distinct adapters one step has batched
        self.step_timings: deque[StepTiming] = deque(maxlen=STEP_LOG)
        self._intake = 0  # requests and prefetch hints taken so far; the prefetcher has seen...
        self._ticked_intake = 0  # ...the first this many

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected with a message fit for the client."""
        n, limit = request.num_prompt_tokens, self.max_model_len
        if n + request.sampling.max_tokens > limit:
            raise RequestRejected(
                f"this model's maximum context length is {limit} tokens; the request has "
                f"{n} prompt tokens and asks for {request.sampling.max_tokens} more"
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestRejected(
                f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})"
            )
        if request.adapter is not None:
            try:
                self.adapters.resolve(request.adapter)
            except AdapterError as e:
                raise RequestRejected(str(e), e.status) from e
            request.cold_adapter = not self.adapters.is_resident(request.adapter)
        self.scheduler.add(request)
        self._intake += 1

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Serve a new adapter by name. Raises RequestRejected (400 bad files or name in use)."""
        try:
            self.adapters.register(name, path, pinned=pinned)
        except AdapterError as e:
            raise RequestRejected(str(e), e.status) from e
        if pinned:
            self.adapters.hint(name, time.monotonic())

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` get 404; queued and running ones finish with it."""
        try:
            self.adapters.unregister(name)
        except AdapterError as e:
            raise RequestRejected(str(e), e.status) from e
        if all(r.adapter != name for r in self.scheduler.requests()):
            self.adapters.forget(name)  # nothing uses it: the name is free again at once

    def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        """Someone outside the engine (the router) expects a request for `adapter` in `eta_s`
        seconds: start bringing it in. Unknown names are ignored."""
        try:
            self.adapters.resolve(adapter)
        except AdapterError:
            return
        self.adapters.hint(adapter, time.monotonic() + eta_s)
        self._intake += 1

    def adapter_status(self) -> dict[str, dict]:
        return self.adapters.status()

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self.runner.forget(request_id)
        return RequestOutput(request_id, [], request.finish_reason, None, request.num_prompt_tokens)

    def _tick_adapters(self) -> None:
        """The adapter manager's per-step work: collect reads; in prefetch mode, queue and
        start loads for the waiting requests' adapters."""
        self._ticked_intake = self._intake
        self.adapters.tick(
            [(r.adapter, r.arrival_time) for r in self.scheduler.waiting if r.adapter is not None]
        )

    def step(self, on_idle: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step. `on_idle()`, if given, runs while the host waits for the step's device
        work (repeatedly, every few hundred microseconds) and may `add_request` or
        `prefetch_hint`: in prefetch mode, the adapters they name start loading during the step,
        not at the next one (a server passes its inbox here). Disk reads that finish while the
        step runs start their copies then too."""
        if self.adapters.retired:  # unloaded while in use: drop once its last request is done
            in_use = {r.adapter for r in self.scheduler.requests()}
            for name in [n for n in self.adapters.retired if n not in in_use]:
                self.adapters.forget(name)
        loads_before = self.adapters.stats.gpu_loads
        self._tick_adapters()
        sched = self.scheduler.schedule()
        blocking_load = (self.adapters.mode == "blocking"
                         and self.adapters.stats.gpu_loads > loads_before)
        self.num_preemptions += len(sched.preempted)
        self.stalled = sched.empty and not sched.failed and self.has_work
        outputs = [
            RequestOutput(r.request_id, [], r.finish_reason, r.error, r.num_prompt_tokens)
            for r in sched.failed
        ]
        if sched.empty:
            return outputs
        self.num_steps += 1
        self.max_adapters_in_step = max(
            self.max_adapters_in_step,
            len({s.request.adapter for s in sched.seqs if s.request.adapter is not None}),
        )
        sampling = [s for s in sched.seqs if s.samples]
        slots = {s.request.slot for s in sched.seqs if s.request.slot is not None}
        started = time.monotonic()
        layer_waits = self.adapters.layer_waits(slots)
        poll = on_idle is not None and self.adapters.mode == "prefetch"
        marked = False

        def while_running() -> bool:
            nonlocal marked
            if not marked:  # every launch of the step is enqueued: copies into other slots may
                self.adapters.mark_used(slots)  # start now, into these after the step
                marked = True
            if on_idle is not None:
                on_idle()
            if poll and (self._intake != self._ticked_intake or self.adapters.read_finished()):
                self._tick_adapters()  # new needs, or a read whose copy can start now
            return poll

        tokens = self.runner.execute(sched.seqs, layer_waits, while_running)
        # The readback waited for the step's device work: this is the step's time. The adapter
        # manager learns from it how long a copy can hide behind a step and behind a prefill.
        elapsed = time.monotonic() - started
        gated = layer_waits is not None or blocking_load
        prefill_tokens = sum(s.num_new_tokens for s in sched.seqs if s.num_new_tokens > 1)
        self.adapters.observe_step(elapsed, prefill_tokens, gated)
        self.step_timings.append(StepTiming(
            sum(s.num_new_tokens for s in sched.seqs), len(sched.seqs),
            gated, self.runner.last_launch_s, elapsed,
        ))
        for seq in sched.seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        for seq, token in zip(sampling, tokens, strict=True):
            request = seq.request
            request.output_token_ids.append(token)
            status = self._finish_status(request, token)
            if status is not None:
                self.scheduler.finish(request, status)
                self.runner.forget(request.request_id)
            metrics = None
            if request.is_finished:
                metrics = {"queue_s": request.queue_s or 0.0,
                           "adapter_wait_s": request.adapter_wait_s}
            outputs.append(
                RequestOutput(
                    request.request_id,
                    [token],
                    request.finish_reason,
                    None,
                    request.num_prompt_tokens,
                    metrics,
                )
            )
        return outputs

    def _finish_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def abort_all(self, message: str) -> list[RequestOutput]:
        """Fail every request (after an unrecoverable step error)."""
        outputs = []
        for request in list(self.scheduler.requests()):
            self.scheduler.abort(request.request_id)
            self.runner.forget(request.request_id)
            outputs.append(
                RequestOutput(request.request_id, [], "error", message, request.num_prompt_tokens)
            )
        return outputs
