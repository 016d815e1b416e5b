"""The engine: requests in, tokens out, one `step()` at a time. No threads, no Ray.

step = schedule -> run the model -> postprocess (append tokens, finish requests), with the
adapter manager's per-step work before the schedule (`before_step`), around the run
(`start_step`, `step_launched`, `poll_during_step`) and after it (`after_step`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable

from replicas.adapters.hub import HubAccess
from replicas.adapters.manager import AdapterManager
from replicas.adapters.peft_config import AdapterError
from replicas.adapters.registry import ServedAdapters
from replicas.config import EngineConfig
from replicas.engine_stats import EngineStats, RoutingStats, StepTiming
from replicas.errors import ErrorKind, ServingError
from replicas.kv_cache import BlockAllocator
from replicas.limits import EngineLimits, LimitExceeded
from replicas.model_runner import ModelRunner
from replicas.models.spec import ModelSpec
from replicas.request import Request, RequestOutput, RequestStatus
from replicas.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from replicas.timed_runner import TimedRunner

logger = logging.getLogger(__name__)
STEP_LOG = 1 << 14  # step timings kept (the most recent)


class RequestRejected(ServingError, ValueError):
    """A request the engine refuses before queueing it (or an adapter it will not load or
    unload), with the kind of the refusal and, for a request's limits, the field at fault."""

    @classmethod
    def of(cls, error: ServingError) -> RequestRejected:
        return cls(error.message, error.kind, param=error.param, code=error.code)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = ModelSpec.from_dir(config.model)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
        )
        self.limits = EngineLimits(self.max_model_len, self.spec.vocab_size)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids + config.eos_token_ids)
        runner_cls = ModelRunner if config.timed_steps is None else TimedRunner
        self.runner = runner_cls(config, self.spec, self.max_model_len)
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
            # The hub as this replica's environment reaches it (HF_ENDPOINT, HF_TOKEN, cache).
            hub=HubAccess.from_env(config.hub_timeout_s, config.max_hub_adapter_bytes),
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
        self.max_adapters_in_step = 0  # the most distinct adapters one step has batched
        self.busy_s = 0.0  # summed step times: busy share = growth / wall time
        self.launch_s = 0.0  # summed host launch times (ModelRunner.last_launch_s)
        self.step_seqs = 0
        self.num_finished = 0
        self._stalled = False
        self._timings: deque[StepTiming] = deque(maxlen=STEP_LOG)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def stalled(self) -> bool:
        """The last step ran nothing while requests wait (only adapter reads are in flight):
        a caller's loop may sleep a little instead of spinning."""
        return self._stalled

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected with a message fit for the client."""
        # Every path to the model comes through here: the limits' one owner (replicas/limits.py).
        try:
            self.limits.check_request(request.prompt_token_ids, request.sampling)
        except LimitExceeded as e:
            raise RequestRejected.of(e) from e
        if request.adapter is not None:
            try:
                # From here on the request goes by its adapter's version: an unload and reload
                # of the name while it runs leaves it on the weights it started with.
                request.adapter = self.adapters.resolve(request.adapter)
            except AdapterError as e:
                raise RequestRejected.of(e) from e
            request.cold_adapter = not self.adapters.is_resident(request.adapter)
        self.scheduler.add(request)
        self.adapters.note_arrival()

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Serve a new adapter by name, its weights file checked against the model (header and
        layout; no tensor data is read). The name may have been unloaded a moment ago with
        requests still running on it: they finish on the old weights, new ones get these.
        Raises RequestRejected (INVALID: bad files or name in use; NOT_FOUND: no such folder)."""
        try:
            self.adapters.register(name, path, pinned=pinned)
        except AdapterError as e:
            raise RequestRejected.of(e) from e

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` are refused (NOT_FOUND) and the name is free to load again at
        once; queued and running ones finish on the old weights, whose slot is freed with the last
        of them. Raises RequestRejected NOT_FOUND when `name` is not served."""
        try:
            self.adapters.unregister(name)
        except AdapterError as e:
            raise RequestRejected.of(e) from e

    def prefetch_hint(self, adapter: str, eta_s: float = 0.0) -> None:
        """Someone outside the engine (the router) expects a request for `adapter` in `eta_s`
        seconds: start bringing it in. Unknown names are ignored."""
        try:
            key = self.adapters.resolve(adapter)
        except AdapterError:
            return
        self.adapters.hint(key, time.monotonic() + eta_s)
        self.adapters.note_arrival()

    def adapter_status(self) -> dict[str, dict]:
        return self.adapters.status()

    def served_adapters(self) -> ServedAdapters:
        return self.adapters.served()

    def preload_adapter(self, name: str, *, into_slot: bool = False,
                        timeout_s: float = 60.0) -> None:
        """Bring an adapter into host memory now, waiting for its disk read, and with
        `into_slot` into a GPU slot too: for benchmarks and tests that time steps without
        loads. Not for a serving loop (it sleeps). Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        key = self.adapters.resolve(name)
        while not self.adapters.prepare(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapter {name!r} was not read within {timeout_s:g} s")
            time.sleep(0.005)
        if into_slot and self.adapters.acquire(key) is not None:
            self.adapters.release(key)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and occupancy."""
        adapters = self.adapters.stats
        return EngineStats(
            num_steps=self.num_steps,
            num_preemptions=self.num_preemptions,
            max_adapters_in_step=self.max_adapters_in_step,
            adapter_disk_reads=adapters.disk_reads,
            adapter_gpu_loads=adapters.gpu_loads,
            adapter_prefetch_loads=adapters.prefetch_loads,
            adapter_hits=adapters.hits,
            adapter_misses=adapters.misses,
            adapter_read_seconds=tuple(adapters.read_seconds),
            resident_adapters=self.adapters.slots.resident,
            num_free_kv_blocks=self.blocks.num_free,
            num_kv_blocks=self.blocks.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            busy_s=self.busy_s,
            launch_s=self.launch_s,
            step_seqs=self.step_seqs,
            num_finished=self.num_finished,
        )

    def routing_stats(self) -> RoutingStats:
        """Where this replica's adapters are (retired ones left out), slots, queue lengths."""
        tiers = self.adapters.residency()
        slots = self.adapters.slots
        return RoutingStats(
            gpu=tuple(tiers["gpu"]),
            loading=tuple(tiers["loading"]),
            host=tuple(tiers["host"]),
            num_slots=slots.num_slots,
            free_slots=slots.num_free,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
        )

    def step_timings(self, since_step: int = 0) -> list[StepTiming]:
        """The timings of the steps after step number `since_step` (`num_steps` then), of the
        most recent STEP_LOG steps."""
        count = min(self.num_steps - since_step, len(self._timings))
        return list(self._timings)[len(self._timings) - count:] if count > 0 else []

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self.runner.forget(request_id)
        return RequestOutput(request_id, [], request.finish_reason, None, request.num_prompt_tokens)

    def step(self, on_idle: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step: schedule -> run the model -> postprocess. `on_idle()`, if given, runs
        while the host waits for the step's device work (repeatedly, every few hundred
        microseconds) and may `add_request` or `prefetch_hint`: in prefetch mode, the adapters
        they name start loading during the step, not at the next one (a server passes its inbox
        here). Disk reads that finish while the step runs start their copies then too."""
        self.adapters.before_step(self._waiting_needs)
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        self._stalled = sched.empty and not sched.failed and self.has_work
        outputs = [
            RequestOutput(
                r.request_id, [], r.finish_reason, r.error, r.num_prompt_tokens,
                error_kind=r.error_kind,
            )
            for r in sched.failed
        ]
        if not sched.empty:
            tokens = self._run(sched, on_idle)
            outputs += self._postprocess(sched, tokens)
        return outputs

    def _run(self, sched: SchedulerOutput, on_idle: Callable[[], None] | None) -> list[int]:
        """Execute the step on the model; returns the sampled tokens (`ModelRunner.execute`)."""
        self.num_steps += 1
        adapters = {s.request.adapter for s in sched.seqs if s.request.adapter is not None}
        self.max_adapters_in_step = max(self.max_adapters_in_step, len(adapters))
        slots = {s.request.slot for s in sched.seqs if s.request.slot is not None}
        started = time.monotonic()
        loads = self.adapters.start_step(slots)
        tokens = self.runner.execute(
            sched.seqs, loads.layer_waits, functools.partial(self._while_running, on_idle)
        )
        # The readback waited for the step's device work: this is the step's time.
        elapsed = time.monotonic() - started
        self.busy_s += elapsed
        self.launch_s += self.runner.last_launch_s
        self.step_seqs += len(sched.seqs)
        prefill_tokens = sum(s.num_new_tokens for s in sched.seqs if s.num_new_tokens > 1)
        self.adapters.after_step(loads, elapsed, prefill_tokens)
        self._timings.append(StepTiming(
            sched.num_tokens, len(sched.seqs), loads.gated, self.runner.last_launch_s, elapsed,
            started,
        ))
        return tokens

    def _while_running(self, on_idle: Callable[[], None] | None) -> bool:
        """While the device runs the step (`ModelRunner.execute`'s `while_running`): the first
        call comes once every launch is enqueued; later ones while this returns True."""
        self.adapters.step_launched()
        if on_idle is None:
            return False
        on_idle()
        return self.adapters.poll_during_step(self._waiting_needs)

    def _postprocess(self, sched: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        """Advance every scheduled request, append the sampled tokens, finish requests."""
        sampled = [s for s in sched.seqs if s.samples]  # before the requests advance
        for seq in sched.seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        outputs = []
        for seq, token in zip(sampled, tokens, strict=True):
            request = seq.request
            request.output_token_ids.append(token)
            status = self._finish_status(request, token)
            if status is not None:
                self.scheduler.finish(request, status)
                self.runner.forget(request.request_id)
                self.num_finished += 1
            metrics = None
            if request.is_finished:
                metrics = {"queue_s": request.queue_s or 0.0,
                           "adapter_wait_s": request.adapter_wait_s}
            outputs.append(RequestOutput(
                request.request_id, [token], request.finish_reason, None,
                request.num_prompt_tokens, metrics,
            ))
        return outputs

    def _waiting_needs(self) -> list[tuple[str, float]]:
        waiting = self.scheduler.waiting
        return [(r.adapter, r.arrival_time) for r in waiting if r.adapter is not None]

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

    def shutdown(self) -> None:
        """Stop the adapter read pool (reads in flight are dropped)."""
        self.adapters.shutdown()

    def abort_all(self, message: str) -> list[RequestOutput]:
        """Fail every request (after an unrecoverable step error): an INTERNAL error each."""
        outputs = []
        for request in list(self.scheduler.requests()):
            self.scheduler.abort(request.request_id)
            self.runner.forget(request.request_id)
            outputs.append(
                RequestOutput(
                    request.request_id, [], "error", message, request.num_prompt_tokens,
                    error_kind=ErrorKind.INTERNAL,
                )
            )
        return outputs
