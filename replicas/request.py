"""The request object that flows through the engine, and its sampling parameters.

One `Request` is created per generation call. The scheduler moves it WAITING -> RUNNING ->
FINISHED_*; a preempted request goes back to WAITING with its KV blocks freed and is recomputed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from replicas.errors import ErrorKind


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` means greedy; `top_k is None` and `top_p == 1`
    mean no truncation. Validation errors are `ValueError` with a message fit for a client."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or null for no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(eq=False)  # a request is itself: membership tests in the scheduler compare identity
class Request:
    """A generation request. `adapter` names the adapter (None: the base model); once queued, it
    is the engine's key for the version the name resolved to (`replicas/adapters/registry.py`),
    the name itself unless the name was reloaded while an older version was still in use.

    KV state: `num_computed_tokens` tokens of `token_ids` have their keys and values written in
    the blocks listed in `block_table`. `slot` is the adapter's GPU slot while the request holds
    it (from admission until it finishes or is preempted).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with `error`: what kind of failure it is
    admitted_at: float | None = None  # first admission (time.monotonic)
    cold_adapter: bool = False  # its adapter was not in a GPU slot when it arrived

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if self.adapter == "":
            raise ValueError("adapter name must be non-empty (use None for the base model)")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (decode reads one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.token_ids[start:end]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrival_time

    @property
    def adapter_wait_s(self) -> float:
        """Time spent waiting for a cold adapter (its whole queueing time, if it was cold)."""
        return (self.queue_s or 0.0) if self.cold_adapter else 0.0

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def is_prefill(self) -> bool:
        return self.num_pending_tokens > 1 or not self.output_token_ids


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for one request after a step: the tokens sampled since the last
    report, and the finish reason once it is done."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    metrics: dict[str, float] | None = None  # on the last output: queue_s, adapter_wait_s
    error_kind: ErrorKind | None = None  # set with `error`: what kind of failure it is

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
