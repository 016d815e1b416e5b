"""What happened to one request: its outcome and timings, as seen by the client."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from workloads.requests import RequestSpec


class Outcome(str, enum.Enum):
    OK = "ok"
    HTTP_ERROR = "http_error"  # the server answered a status other than 200
    STREAM_ERROR = "stream_error"  # an error event, a malformed event, or no content at all
    TIMEOUT = "timeout"  # the request ran past the per-request timeout
    TRANSPORT_ERROR = "transport_error"  # connection refused or reset, protocol error
    ABORTED = "aborted"  # still running when the run's total timeout came
    NOT_SENT = "not_sent"  # its send time came after the run's total timeout


@dataclass(frozen=True)
class RequestRecord:
    """Times are seconds: `scheduled_s` and `sent_s` from the start of the run, the others from
    `sent_s`. `itl_s` has one entry per output token after the first chunk (tokens that arrive
    together in one chunk share the chunk's gap). `output_tokens` is the server's
    `usage.completion_tokens`, or the number of content chunks when it reports no usage."""

    index: int
    model: str
    is_base: bool
    input_len: int  # asked for (tokens, or words for text prompts)
    output_len: int  # asked for, as max_tokens
    scheduled_s: float
    outcome: Outcome
    sent_s: float | None = None
    # Until the request was written on its connection (a new connection's TCP connect
    # included): a client or listener short of connections shows here, not in the server.
    written_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens, when reported
    status: int | None = None  # HTTP status, when one came
    error: str | None = None
    # Chunks the per-chunk gaps were spread over; a chunk with several tokens means TTFT or ITL
    # hides work (speculative decoding, server-side batching of deltas).
    num_chunks: int = 0

    def __post_init__(self) -> None:
        if self.ok:
            assert self.ttft_s is not None and self.e2e_s is not None, "an ok record is timed"
            assert 0 <= self.ttft_s <= self.e2e_s, (self.ttft_s, self.e2e_s)
            assert self.output_tokens >= 1 and self.error is None
        else:
            assert self.error, "a failed record says why"

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def unfinished(cls, spec: RequestSpec, scheduled_s: float, outcome: Outcome) -> RequestRecord:
        reason = {
            Outcome.ABORTED: "aborted at the run's total timeout",
            Outcome.NOT_SENT: "not sent before the run's total timeout",
        }[outcome]
        return cls.of(spec, scheduled_s, outcome, error=reason)

    @classmethod
    def of(
        cls, spec: RequestSpec, scheduled_s: float, outcome: Outcome, **timings
    ) -> RequestRecord:
        return cls(
            index=spec.index,
            model=spec.model,
            is_base=spec.is_base,
            input_len=spec.input_len,
            output_len=spec.output_len,
            scheduled_s=scheduled_s,
            outcome=outcome,
            **timings,
        )

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "outcome": self.outcome.value,
            "tpot_s": self.tpot_s,
            "itl_s": list(self.itl_s),
        }
