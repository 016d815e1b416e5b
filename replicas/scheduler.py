"""Continuous-batching scheduler. Plain Python: no torch, no Ray.

Each step mixes decodes and prefill chunks under a token budget:
1. Running requests first, oldest first: a decode costs one token, an unfinished prefill
   continues with as large a chunk as the budget allows. When the KV cache is full, the newest
   running request is preempted (blocks freed, recomputed later) so older ones progress.
2. Then waiting requests in arrival order, while there is room (`max_num_seqs`, the token budget,
   free KV blocks). A request for an adapter needs a hold on the adapter's slot; if no slot can be
   had now, the request stays waiting and later requests may pass it only when they need no new
   slot (the base model, or an adapter already resident), so the blocked request gets the next
   slot that frees up instead of being starved by newcomers.

Joint prefills. Admission asks only that an adapter's weights be in host memory and that it
hold a slot; it does not wait for the host->GPU copy to finish. The copy runs on the load stream
with one event per layer, and the step's layer L waits only for layer L. So requests for several
cold adapters that arrive close together are admitted in the same step and prefilled as one
mixed-adapter batch (SGMV serves every adapter in one launch), instead of one small prefill per
adapter as each copy completes; the token budget is the only thing that splits them. We chose
this over holding ready requests back to gather more: a hold costs every request its wait, while
a joint prefill costs one step that is longer by the copies still in flight, which the
prefetcher usually finished before admission.

One exception keeps long copies from stalling everyone: while other requests run, a request
whose adapter's copy is expected to land later than two steps from now (a large rank: tens of
milliseconds over PCIe; or a copy queued behind others on the load stream, which runs them in
order) waits until most of it has landed (`AdapterGate.copy_settled`), so the running
requests' steps are not stretched to the copies' length. Shorter copies are admitted at
once: they arrive layer by layer while earlier layers compute, and stretch the step they join by
at most one step, which is what waiting a step would cost the new request. "Shorter" counts
the request's own prefill too: a step that computes a long prompt takes that much longer, and a
copy landing under it stretches it no more than a short copy stretches a decode step (a prompt of
600 tokens on an 8B model takes about as long as a rank-256 copy over PCIe). Any copy is admitted
at once when nothing else runs. The rule bounds copies the prefetcher started ahead of
admission; without the prefetcher (overlap mode) a copy starts at admission and the step
absorbs it.

KV headroom. Running requests grow by a token a step, and when the cache runs out the newest is
preempted and later recomputed from scratch: its prefill is wasted, and under a steady overload
admitting newcomers into a nearly full cache turns into a cycle of preemptions. So a waiting
request is admitted only if, after its blocks, the free blocks still cover `reserve_ratio` of
the tokens the running requests may yet add (their remaining prompt in full, their remaining
`max_tokens` times the ratio). The ratio starts at `kv_reserve_ratio`, shrinks a little every
step without a preemption down to `min_kv_reserve_ratio` (requests rarely use all their
`max_tokens`, so a full reservation would leave the cache idle), and returns to
`kv_reserve_ratio` at each preemption. A request's remaining output counts at most
RESERVE_CLIP_TOKENS: a request that names no `max_tokens` may run to the end of a long context,
and reserving all of it would keep a long-context engine nearly empty. With nothing running, a
request is admitted whenever its first chunk fits, so the engine always makes progress. A ratio
of 0 turns the reservation off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from replicas.errors import ServingError
from replicas.kv_cache import BlockAllocator, blocks_for
from replicas.request import Request, RequestStatus

RESERVE_CLIP_TOKENS = 4096  # the most remaining output one request counts for (KV headroom)


class AdapterLoadError(ServingError, RuntimeError):
    """An adapter could not be made resident (bad files, unknown name, a failed download). Fails
    only its request, with its `kind` (INVALID bad files, NOT_FOUND gone, UNAVAILABLE the hub
    failed)."""


class AdapterGate(Protocol):
    """Where the scheduler gets adapter slots. Implemented by the engine's adapter manager."""

    def attach(self, adapter: str) -> None:
        """A request on the adapter was queued (`Scheduler.add`); once for each request."""

    def detach(self, adapter: str) -> None:
        """A request on the adapter ended (finished, failed or aborted: never a preemption, which
        queues it again), after its slot hold was released."""

    def is_resident(self, adapter: str) -> bool:
        """The adapter already sits in a slot (acquiring it needs no new slot)."""

    def prepare(self, adapter: str) -> bool:
        """The adapter can be placed now (its weights are in memory); otherwise start fetching
        it and return False, without blocking. Raises AdapterLoadError."""

    def copy_settled(self, adapter: str, prefill_tokens: int = 0) -> bool:
        """Admitting a request for the adapter with `prefill_tokens` to compute now would not
        hold the step up for long: no host->GPU copy of it is in flight, or the copy lands within
        about two steps plus the time those tokens add, or most of it has landed. Checked
        without blocking."""

    def acquire(self, adapter: str) -> int | None:
        """Hold the adapter's slot for one request, making it resident first if needed. Returns
        the slot, or None when no slot can be had now. Raises AdapterLoadError."""

    def release(self, adapter: str) -> None:
        """Drop one hold taken by `acquire`."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_reserve_ratio: float = 0.5  # KV headroom for running requests' outputs, after a preemption
    min_kv_reserve_ratio: float = 0.05  # ... decaying to this while no preemption happens
    kv_reserve_decay: float = 0.002  # per step

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_kv_reserve_ratio <= self.kv_reserve_ratio <= 1.0:
            raise ValueError("need 0 <= min_kv_reserve_ratio <= kv_reserve_ratio <= 1")
        if self.kv_reserve_decay < 0:
            raise ValueError("kv_reserve_decay cannot be negative")


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # tokens fed to the model this step, from request.num_computed_tokens

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the known tokens, so the step samples the next one."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # refused at admission, now finished
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockAllocator,
        adapters: AdapterGate,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock  # stamps admissions (a simulator passes its virtual clock)
        self.blocks = blocks
        self.adapters = adapters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserve_ratio = config.kv_reserve_ratio  # runtime value: see "KV headroom" above

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> Iterator[Request]:
        yield from self.running
        yield from self.waiting

    def add(self, request: Request) -> None:
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id} is {request.status}, not waiting")
        if request.adapter is not None:
            self.adapters.attach(request.adapter)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
                    return request
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running request (stop, length or error): frees its blocks and slot."""
        self.running.remove(request)
        self._finish(request, status)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            n = min(request.num_pending_tokens, budget)
            while not self.blocks.grow(request.block_table, request.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.seqs.append(ScheduledSeq(request, n))
                budget -= n
        cfg = self.config
        if out.preempted:
            self.reserve_ratio = cfg.kv_reserve_ratio
        else:
            self.reserve_ratio = max(cfg.min_kv_reserve_ratio,
                                     self.reserve_ratio - cfg.kv_reserve_decay)
            budget = self._admit(out, budget)
        return out

    def _future_blocks(self, request: Request, scheduled: int) -> float:
        """KV blocks `request` may still need beyond what it holds once `scheduled` tokens of
        this step are in: the rest of its prompt in full, its remaining output scaled by the
        reserve ratio."""
        prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens - scheduled)
        final = min(request.num_prompt_tokens + request.sampling.max_tokens,
                    self.config.max_model_len)
        # num_tokens covers the whole prompt, so this counts output tokens alone
        output_left = final - max(request.num_tokens, request.num_computed_tokens + scheduled)
        output_left = min(RESERVE_CLIP_TOKENS, max(0, output_left))
        tokens = prompt_left + self.reserve_ratio * output_left
        return tokens / self.blocks.block_size

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting:  # the headroom sum below walks every running request
            return budget
        slot_blocked = False
        scheduled = {id(s.request): s.num_new_tokens for s in out.seqs}
        reserve = sum(self._future_blocks(r, scheduled.get(id(r), 0)) for r in self.running)
        for request in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = min(request.num_pending_tokens, budget)
            if request.adapter is not None:
                if slot_blocked and not self.adapters.is_resident(request.adapter):
                    continue
                try:
                    if not self.adapters.prepare(request.adapter):
                        continue  # still being read from disk; later requests may go first
                    if self.running and not self.adapters.copy_settled(request.adapter, n):
                        continue  # a long copy still arriving: admitted a step later instead
                    slot = self.adapters.acquire(request.adapter)
                except AdapterLoadError as e:
                    self.waiting.remove(request)
                    request.error = str(e)
                    request.error_kind = e.kind
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    out.failed.append(request)
                    continue
                if slot is None:
                    slot_blocked = True
                    continue
                request.slot = slot
            held = len(request.block_table)
            need = blocks_for(request.num_computed_tokens + n, self.blocks.block_size) - held
            if self.running and self.blocks.num_free - need < reserve:
                self._release_slot(request)
                break  # the running requests' headroom comes first
            if not self.blocks.grow(request.block_table, request.num_computed_tokens + n):
                self._release_slot(request)
                break
            reserve += self._future_blocks(request, n)
            self.waiting.remove(request)
            if request.admitted_at is None:
                request.admitted_at = self.clock()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.seqs.append(ScheduledSeq(request, n))
            budget -= n
        return budget

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free_resources(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._free_resources(request)
        request.status = status
        if request.adapter is not None:
            self.adapters.detach(request.adapter)

    def _free_resources(self, request: Request) -> None:
        if request.block_table:
            self.blocks.free(request.block_table)
            request.block_table = []
        self._release_slot(request)

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            assert request.adapter is not None  # only a request for an adapter takes a slot
            self.adapters.release(request.adapter)
            request.slot = None
