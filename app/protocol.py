"""OpenAI-compatible request and response bodies, and the error every route answers with.

Requests accept what OpenAI clients send. Fields the engine cannot honour are refused with a 400
when set to anything but their neutral value (`n`, `echo`, `logprobs`, penalties, ...), instead
of being silently ignored. Unknown fields are ignored, as OpenAI-compatible servers do. Text
anywhere in a request must be valid Unicode (`RequestBody`), and integers the engine takes as
64-bit are bounded here, so a client's mistake is a 400 rather than a failure further in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from replicas.errors import ErrorKind

MAX_STOP_SEQUENCES = 4


# ---------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# The one place a kind of error becomes an HTTP status; the statuses of the HTTP layer itself
# (401, 403, 405, 413) are raised by the ingress as they are.
HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


RETRY_AFTER_S = 1  # what a 503 tells a client to wait before trying again
# A failure of ours (a bug, an engine fault): its details go to the log, never to the client.
INTERNAL_ERROR = "the server failed to complete this request (an internal error, logged)"


class APIError(Exception):
    """A request that fails with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or error_type(status)
        self.param = param
        self.code = code

    @classmethod
    def of(
        cls,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> APIError:
        """The answer to an error of this kind: its HTTP status and OpenAI error type."""
        return cls(message, HTTP_STATUS[kind], param=param, code=code)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries: `Retry-After` on a 503 (the server cannot take the
        request now: an engine replica is down, the hub does not answer)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


# ---------------------------------------------------------------------------------------------
# Requests

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


MAX_BODY_DEPTH = 32  # objects and arrays within each other; OpenAI's bodies need a few


def body_problem(data: Any) -> str | None:
    """What makes JSON-decoded `data` unfit for the server, or None: nesting deeper than
    `MAX_BODY_DEPTH` (chat template variables are walked recursively further in), or a string
    (or a key) holding a lone UTF-16 surrogate. JSON may escape one (`"\\ud800"`) and Python
    decodes it, but such a string is not Unicode: no tokenizer, template or UTF-8 encoder takes
    it. Walks iteratively, skipping numbers (a prompt may be a long list of token ids)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return f"{_dotted(where)} holds {_SURROGATE}"
            continue
        if len(where) >= MAX_BODY_DEPTH:
            return f"{_dotted(where)} is nested deeper than {MAX_BODY_DEPTH} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not _is_unicode(key):
                    return f"a key in {_dotted(where)} holds {_SURROGATE}"
                if type(item) in _WALKED:
                    stack.append(((*where, key), item))
        elif isinstance(value, list):
            stack.extend(
                ((*where, i), item) for i, item in enumerate(value) if type(item) in _WALKED
            )
    return None


# What json.loads makes that holds text: exact types, so a set lookup stands in for isinstance
# (a prompt of 400 token ids is walked in ~10 µs rather than ~90).
_WALKED = frozenset({str, dict, list})


_SURROGATE = (
    "a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), which is not "
    "valid Unicode"
)


def _dotted(where: tuple[Any, ...]) -> str:
    path = ".".join(str(part) for part in where) or "the body"
    return path.encode("utf-8", "backslashreplace").decode()[:200]


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestBody(BaseModel):
    """A request body: strings anywhere in it must be valid Unicode, and its nesting bounded
    (400 otherwise). Its values must have the types its schema declares, as OpenAI's API wants:
    no coercion (`"5"` or `true` is not an integer, `1` is not a boolean)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _sound_json(cls, data: Any) -> Any:
        problem = body_problem(data)
        if problem is not None:
            raise ValueError(problem)
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


@dataclass(frozen=True)
class Unsupported:
    """A request field the engine cannot honour: `accepts` tells its neutral values (the only
    ones allowed), `message` is the 400's text (`{value}` is the value sent)."""

    accepts: Callable[[Any], bool]
    message: str


def _unset(value: Any) -> bool:
    return not value


_NO_PENALTY = Unsupported(
    lambda v: v == 0.0, "presence and frequency penalties are not supported (only 0)"
)


def refuse_unsupported(fields: Mapping[str, Unsupported]) -> Any:
    """A validator of `fields` (a table of the model's unsupported fields) that refuses each
    field set to a value it does not accept. Give each model's its own attribute name: a
    subclass's validator of the same name would replace its parent's."""

    def check(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
        rule = fields[info.field_name or ""]
        if not rule.accepts(value):
            raise ValueError(rule.message.format(value=value))
        return value

    return field_validator(*fields)(classmethod(check))


class SamplingFields(RequestBody):
    """What completions and chat requests share: sampling, stops, streaming, unsupported knobs."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None, description="0 is greedy; default 1.")
    top_p: float | None = Field(default=None, description="Nucleus sampling; default 1.")
    top_k: int | None = Field(
        default=None, description="Extension: sample among the k likeliest; null, -1 or 0: off."
    )
    seed: int | None = Field(
        default=None, ge=INT64_MIN, le=INT64_MAX, description="A 64-bit signed integer."
    )
    stop: str | list[str] | None = Field(default=None, description="Up to 4 stop strings.")
    stop_token_ids: list[int] | None = Field(
        default=None, description="Extension: token ids that end generation."
    )
    ignore_eos: bool = Field(default=False, description="Extension: keep going past EOS.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    _sampling_supported = refuse_unsupported(
        {
            "n": Unsupported(lambda n: n == 1, "only n=1 is supported, got {value}"),
            "presence_penalty": _NO_PENALTY,
            "frequency_penalty": _NO_PENALTY,
            "logit_bias": Unsupported(_unset, "logit_bias is not supported"),
        }
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        # The validator has turned `stop` into a list.
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_k_or_none(self) -> int | None:
        """vLLM's convention: -1 and 0 turn top-k off."""
        return None if self.top_k in (None, -1, 0) else self.top_k


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. One prompt per request: text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(
        default=16, description="Tokens to generate; null: up to the context length."
    )
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    _completion_supported = refuse_unsupported(
        {
            "echo": Unsupported(_unset, "echo is not supported"),
            "logprobs": Unsupported(lambda v: v is None, "logprobs is not supported (only null)"),
            "best_of": Unsupported(lambda v: v in (None, 1), "best_of is not supported (only 1)"),
            "suffix": Unsupported(_unset, "suffix is not supported"),
        }
    )

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(
                    f"batched prompts are not supported: got {len(prompt)} prompts, send one "
                    "prompt per request"
                )
            prompt = prompt[0]
            if isinstance(prompt, str):
                return prompt
        if not prompt:
            raise ValueError("the prompt must not be empty")
        return cast("list[int]", prompt)  # what the union leaves: one prompt of token ids


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        if self.text is None:
            raise ValueError("a text content part needs a `text` field")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


# transformers' `apply_chat_template` parameters: not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        default=None, description="Deprecated by OpenAI; still honoured."
    )
    max_completion_tokens: int | None = Field(
        default=None, description="Tokens to generate; null: up to the context length."
    )
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = Field(
        default=True, description="Extension: end the prompt with the assistant turn's header."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extension: extra variables for the chat template."
    )

    _chat_supported = refuse_unsupported(
        {
            "logprobs": Unsupported(_unset, "logprobs is not supported (only false)"),
            "top_logprobs": Unsupported(_unset, "top_logprobs is not supported"),
            "tools": Unsupported(_unset, "tools are not supported"),
            "tool_choice": Unsupported(
                lambda v: v in (None, "none", "auto"),
                "tool_choice is not supported (tools are not supported)",
            ),
            "response_format": Unsupported(
                lambda v: v is None or v.get("type") == "text",
                "response_format is not supported (only {{'type': 'text'}})",
            ),
        }
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            # A client-supplied `chat_template` would be a template of its own choosing (its
            # loops run on this server); the others are how the server calls the template.
            raise ValueError(f"these keys may not be set: {taken}")
        return kwargs

    @property
    def output_token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# ---------------------------------------------------------------------------------------------
# Responses


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE event of a streamed completion; `object` is `text_completion` as in OpenAI's."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only the keys that changed: `{}` on the final chunk.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "lorafleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------
# Adapter management (vLLM's routes, plus `pinned`)


class LoadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(description="The name requests will use in `model`.")
    lora_path: str = Field(
        description="The PEFT folder, readable at this same path on every engine node."
    )
    pinned: bool = Field(
        default=False, description="Extension: keep it on the GPU once loaded (never evicted)."
    )


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(description="The adapter to stop serving.")


class ReplicaState(BaseModel):
    replica_id: str | None  # None: a replica that failed without naming itself
    available: bool
    error: str | None = None


class AdapterPlacement(BaseModel):
    replica_id: str | None
    # gpu/loading/host/disk: the replica's tier; for a hub adapter not on the replica's disk
    # yet, downloading or hub; absent: the replica does not serve it; unavailable: the replica
    # did not answer.
    tier: Literal[
        "gpu", "loading", "host", "disk", "downloading", "hub", "absent", "unavailable"
    ]
    slot: int | None = None


class AdapterCard(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    source: Literal["config", "runtime", "adapter_root", "hub"]
    path: str | None  # a folder, or hf://org/name@<commit>
    rank: int | None  # the largest rank over its modules
    size_bytes: int | None  # its weights in a replica's memory; None until one has read them
    pinned: bool
    replicas: list[AdapterPlacement]


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]
    replicas: list[ReplicaState]
