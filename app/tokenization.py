"""Text in, token ids out, and back: the tokenizer, chat templates, and streamed detokenization.

`TokenizerPool` runs the heavy direction (a prompt of up to max_model_len tokens, a chat template
over a long conversation) on worker threads, so the ingress event loop keeps answering other
requests and /health meanwhile.

The engine streams token ids; `TextStream` turns them into text deltas a client can show as they
come: never half a UTF-8 character, never the start of a stop string that may still complete.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
# Prompt tokens decoded ahead of the output, so tokenizers that render a token's leading space
# only after another token (SentencePiece) get the first output token right.
_PROMPT_CONTEXT_TOKENS = 5
# Texts from this many characters on are tokenized in TokenizerPool's long lane (a few thousand
# tokens: milliseconds of work and more).
LONG_TEXT_CHARS = 16384


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template refused it."""


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of a model folder (local files only) or hub id."""
    from transformers import AutoTokenizer

    local = Path(model).is_dir()
    return AutoTokenizer.from_pretrained(str(model), local_files_only=local)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completion prompt, with the special tokens the tokenizer adds (BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render `messages` (dicts with `role` and string `content`) with the tokenizer's chat
    template and tokenize the result. The template writes its own special tokens (BOS), so none
    are added. Raises `ChatTemplateError` when there is no template or the template fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; use /v1/completions with a plain prompt"
        )
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError, KeyError, RecursionError) as e:
        raise ChatTemplateError(f"the chat template could not render these messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


class TokenizerPool:
    """Prompt encoding and chat templates off the event loop, in two lanes.

    A text of `long_text_chars` characters or more (a prompt, or a conversation's contents
    together) goes to the long lane, anything shorter to the short lane; each lane is one worker
    thread. So a long prompt never holds up a short one, and the tokenizer is used by at most
    two threads. Rendering a Jinja template holds the GIL, but the event loop gets it back
    between the worker's slices (and the Rust encoder releases it), so the loop keeps answering
    meanwhile.

    transformers' fast tokenizers adjust the Rust tokenizer's truncation and padding on each
    call when they differ from what the call asks, and that mutation fails when another thread
    is encoding ("Already borrowed"). Our calls never truncate or pad, so one call here, before
    any worker runs, leaves nothing to adjust; from then on the workers only read it.

    Streamed detokenization (`TextStream`) stays on the event loop: a few tokens at a time.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, long_text_chars: int = LONG_TEXT_CHARS
    ) -> None:
        self.tokenizer = tokenizer
        self.long_text_chars = long_text_chars
        encode_prompt(tokenizer, "")  # clears truncation and padding once, on this thread
        self._short = ThreadPoolExecutor(1, thread_name_prefix="tokenize-short")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="tokenize-long")

    async def encode_prompt(self, text: str) -> list[int]:
        return await self._run(len(text), encode_prompt, self.tokenizer, text)

    async def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        size = sum(len(str(m.get("content", ""))) for m in messages)
        render = functools.partial(
            apply_chat_template,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )
        return await self._run(size, render, self.tokenizer, messages)

    async def _run(self, size: int, fn: Any, *args: Any) -> list[int]:
        lane = self._long if size >= self.long_text_chars else self._short
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def shutdown(self) -> None:
        for lane in (self._short, self._long):
            lane.shutdown(wait=False, cancel_futures=True)


class IncrementalDetokenizer:
    """Token ids in, text deltas out, decoding only a short window of recent tokens.

    Decoding one token at a time is wrong for byte-level tokenizers (a character may span
    several tokens) and for SentencePiece (a token's leading space depends on its neighbour).
    So each step decodes `ids[prefix:]` and `ids[prefix:read]` and emits the difference, then
    slides the window; while the text ends in U+FFFD (an incomplete character) nothing is emitted
    and the window stays, until the character completes or `flush` is called at the end.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        # Every transformers tokenizer has `_decode` (one sequence's `decode`); `decode` if not.
        self._raw_decode = cast(Callable[..., str], getattr(tokenizer, "_decode", tokenizer.decode))
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if REPLACEMENT_CHAR in self._decode(context):
            context = []  # a prompt ending mid-character would shift every delta
        self._ids: list[int] = context
        self._prefix = 0  # ids[prefix:read] is the window already emitted as text
        self._read = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        # A list of ints needs none of `decode`'s conversions (tensors, arrays, batches): its
        # `_decode` (special tokens and clean-up as `decode` has them) is 2 µs a call instead
        # of 5, twice a chunk.
        return self._raw_decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; return the text they complete (maybe empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the stream: the held-back text, incomplete characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Text deltas in, the part safe to emit out; `stopped` once a stop string appears.

    Text that could be the start of a stop string is held back until it either completes the
    stop string (it is dropped, with everything after it) or stops matching (it is emitted).
    When several stop strings appear, the one that completes first wins (the longest on a tie).
    Invariant: the held-back text never contains a whole stop string, and is shorter than the
    longest one, so each call searches a short buffer.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._pending = ""
        self.stopped = False

    @property
    def held_back(self) -> str:
        """Text received but not emitted yet: it may be the start of a stop string."""
        return self._pending

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stop:
            return text
        buffer = self._pending + text
        # The stop string completed first wins (as if checked after every character), so the
        # result does not depend on how the text was split into deltas.
        hits = [(i + len(s), i) for s in self._stop if (i := buffer.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buffer[: min(hits)[1]]
        keep = self._partial_match_length(buffer)
        self._pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a prefix of some stop string."""
        longest = max(len(s) for s in self._stop) - 1
        for k in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def flush(self) -> str:
        """At the end of the stream: the held-back text (it never became a stop string)."""
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text


class TextStream:
    """One request's output text: incremental detokenization, then stop strings.

    `add(token_ids)` returns the next text delta; once `stopped` is true the caller must stop the
    engine stream and finish with finish_reason "stop". `finish()` returns the remaining text
    when the engine ends the stream itself.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._matcher = StopStringMatcher(stop)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        return self._matcher.feed(self._detokenizer.decode(token_ids))

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self._matcher.feed(self._detokenizer.flush())
        return text + self._matcher.flush()
