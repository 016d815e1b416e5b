"""What a request must fit to reach the model: its prompt and output inside the context, its
token ids inside the vocabulary. Plain Python: no torch, no Ray.

Who owns these checks: this module, for every path to the model. The engine applies them to
each request it queues (`Engine.add_request`): the HTTP ingress, the in-process benchmark driver
and tests all reach the model through it, so none sends a token id outside the embedding table
or a position past the context to a kernel. The ingress applies the same checks, with the
limits the engine reports (`EngineDeployment.info`), before it calls the engine
(`app/service.py`): an HTTP client's 400 then comes without a Ray hop, and its text is the one
the engine would have given. Nothing else checks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replicas.errors import ServingError
from replicas.request import SamplingParams


class LimitExceeded(ServingError, ValueError):
    """A request the model cannot take (INVALID). `param` names the request field at fault
    (OpenAI's error `param`); `code` is OpenAI's error code, when it has one."""


@dataclass(frozen=True)
class EngineLimits:
    """The model's context length (`max_model_len`, in tokens: prompt plus output) and its
    vocabulary (`vocab_size`: token ids run from 0 to `vocab_size - 1`)."""

    max_model_len: int
    vocab_size: int

    def output_budget(
        self, prompt_token_ids: Sequence[int], max_tokens: int | None, *, prompt_param: str
    ) -> int:
        """The tokens a request may generate: `max_tokens`, or what the context leaves when it is
        None. Raises `LimitExceeded` for a prompt token outside the vocabulary, an empty prompt,
        a prompt that leaves no room, or a `max_tokens` beyond the context (`prompt_param` names
        the prompt's field). A `max_tokens` below 1 is left to `SamplingParams` to refuse."""
        self.check_token_ids(prompt_token_ids, param=prompt_param, what="token id")
        n, limit = len(prompt_token_ids), self.max_model_len
        if n == 0:
            raise LimitExceeded(
                "the prompt is empty: it must encode to at least one token", param=prompt_param
            )
        if n >= limit:
            raise LimitExceeded(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {n} tokens, which leaves no room for the completion. Please reduce the "
                "length of the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - n
        if max_tokens >= 1 and n + max_tokens > limit:
            raise LimitExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def check_token_ids(self, token_ids: Sequence[int], *, param: str, what: str) -> None:
        """Raises `LimitExceeded` naming the first of `token_ids` outside the vocabulary."""
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise LimitExceeded(
                    f"{what} {t} is outside the vocabulary (0..{self.vocab_size - 1})", param=param
                )

    def check_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_param: str = "prompt",
    ) -> None:
        """Raises `LimitExceeded` unless the prompt and `sampling.max_tokens` fit the context and
        every prompt and stop token id is in the vocabulary."""
        self.output_budget(prompt_token_ids, sampling.max_tokens, prompt_param=prompt_param)
        self.check_token_ids(sampling.stop_token_ids, param="stop_token_ids", what="stop token id")
