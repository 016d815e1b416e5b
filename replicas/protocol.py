"""What crosses the boundary between the ingress and an engine replica.

`EngineDeployment.generate(GenerateRequest)` is an async generator of `GenerateChunk`s: zero or
more chunks of new token ids, the last one carrying `finish_reason`. A request the engine refuses
yields exactly one chunk with `error` set and `finish_reason == "error"`. Cancelling the generator
(client disconnect) aborts the request and frees its KV blocks and adapter slot.

A caller with a channel open on the replica (`EngineDeployment.channel`) gets a request's first
and last chunks on the request's own stream and the ones between on the channel, batched with
its other requests' (one Ray item an interval for all of them). Every chunk says where its tokens
start in the output (`start`), so the caller puts the two streams back in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.errors import ErrorKind, ServingError
from replicas.request import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # adapter name, None for the base model


@dataclass(frozen=True)
class EngineError:
    """Why a request failed, as data: a `ServingError`'s message, kind, `param` and `code`.
    The ingress answers it with the HTTP status and error type of its kind."""

    message: str
    kind: ErrorKind = ErrorKind.INVALID
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: ServingError) -> EngineError:
        return cls(error.message, error.kind, error.param, error.code)


@dataclass(frozen=True)
class GenerateChunk:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    error: EngineError | None = None
    metrics: dict[str, float] | None = None  # on the last chunk: queue_s, adapter_wait_s
    start: int = 0  # where token_ids start in the request's output
    replica_id: str | None = None  # on the first chunk: the engine replica serving it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
