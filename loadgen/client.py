"""A streaming client for OpenAI-compatible servers: one request in, one `RequestRecord` out.

Requests ask for exactly `output_len` tokens (`max_tokens` with `ignore_eos`, greedy by default)
and for the token counts at the end of the stream (`stream_options.include_usage`), which is
how chunks that carry several tokens are detected. Servers that also report usage on every chunk
(vLLM's `continuous_usage_stats`) give exact per-chunk counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loadgen.metrics import chunk_token_counts, inter_token_latencies
from loadgen.records import Outcome, RequestRecord
from workloads.requests import RequestSpec

Endpoint = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class _Stream:
    """What one response stream has shown so far."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_usage: list[int | None] = field(default_factory=list)  # cumulative, when reported
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    written_at: float | None = None  # perf_counter when the request's body was on the wire

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpx's trace hook (`extensions={"trace": ...}`): notes when the body was sent."""
        if event.endswith("send_request_body.complete"):
            self.written_at = time.perf_counter()

    def add_usage(self, usage: dict[str, Any] | None) -> None:
        if usage:
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)

    def chunk_tokens(self) -> list[int]:
        """Tokens per content chunk: exact when every chunk came with cumulative usage, else
        estimated from the final total."""
        n = len(self.chunk_times)
        if n and all(u is not None for u in self.chunk_usage):
            usage = self.chunk_usage
            counts = [b - a for a, b in zip([0, *usage[:-1]], usage, strict=True)]
            if all(c >= 1 for c in counts):
                return counts
        return chunk_token_counts(n, self.completion_tokens or n)


class OpenAIClient:
    """Sends `RequestSpec`s to `base_url` and times them.

    Use as `async with OpenAIClient(...) as client:`. `send` never raises for a failed request:
    the failure is in the record. `transport` replaces the network (tests).
    """

    def __init__(
        self,
        base_url: str,
        endpoint: Endpoint = "completions",
        *,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if endpoint not in PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(PATHS)}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.request_timeout_s = request_timeout_s
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeout=httpx.Timeout(request_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=transport,
        )

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    async def list_models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`'s cards; raises `httpx.HTTPError` when it fails."""
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        return list(response.json().get("data", []))

    async def adapter_stats(self) -> dict[str, Any] | None:
        """`GET /v1/adapters`, or None where the server has no such route (or it fails)."""
        try:
            response = await self._http.get("/v1/adapters")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": spec.model,
            "max_tokens": spec.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        prompt = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
        if self.endpoint == "chat":
            if not isinstance(prompt, str):
                raise ValueError("chat requests need text prompts")
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def send(self, spec: RequestSpec, scheduled_s: float, t0: float) -> RequestRecord:
        """Send `spec` now; times in the record are relative to `t0` (a `perf_counter` value)."""
        stream = _Stream()
        start = time.perf_counter()
        timed: dict[str, Any] = dict(sent_s=start - t0)
        try:
            try:
                await asyncio.wait_for(self._consume(spec, stream), self.request_timeout_s)
            finally:
                if stream.written_at is not None:
                    timed["written_s"] = stream.written_at - start
        except _Failed as failed:
            return RequestRecord.of(
                spec,
                scheduled_s,
                failed.outcome,
                status=failed.status,
                error=failed.message,
                **timed,
            )
        except asyncio.TimeoutError:
            error = f"no answer within {self.request_timeout_s:g} s"
            return RequestRecord.of(spec, scheduled_s, Outcome.TIMEOUT, error=error, **timed)
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return RequestRecord.of(
                spec, scheduled_s, Outcome.TRANSPORT_ERROR, error=error, **timed
            )
        end = time.perf_counter()
        if not stream.chunk_times:
            return RequestRecord.of(
                spec,
                scheduled_s,
                Outcome.STREAM_ERROR,
                status=200,
                error="the stream ended with no content",
                **timed,
            )
        chunk_tokens = stream.chunk_tokens()
        return RequestRecord.of(
            spec,
            scheduled_s,
            Outcome.OK,
            status=200,
            ttft_s=stream.chunk_times[0] - start,
            e2e_s=end - start,
            itl_s=tuple(inter_token_latencies(stream.chunk_times, chunk_tokens)),
            output_tokens=stream.completion_tokens or sum(chunk_tokens),
            prompt_tokens=stream.prompt_tokens,
            num_chunks=len(stream.chunk_times),
            **timed,
        )

    async def _consume(self, spec: RequestSpec, stream: _Stream) -> None:
        """Read the SSE response into `stream`; raise `_Failed` on an error status or event."""
        path, body, trace = PATHS[self.endpoint], self.payload(spec), {"trace": stream.trace}
        async with self._http.stream("POST", path, json=body, extensions=trace) as r:
            if r.status_code != 200:
                raise _Failed(Outcome.HTTP_ERROR, r.status_code, _error_message(await r.aread()))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                now = time.perf_counter()
                try:
                    event = json.loads(data)
                except ValueError:
                    raise _Failed(
                        Outcome.STREAM_ERROR, 200, f"malformed event: {data[:200]}"
                    ) from None
                if "error" in event:
                    raise _Failed(Outcome.STREAM_ERROR, 200, _error_message(data.encode()))
                usage = event.get("usage")
                stream.add_usage(usage)
                if self._content(event):
                    stream.chunk_times.append(now)
                    stream.chunk_usage.append((usage or {}).get("completion_tokens"))

    def _content(self, event: dict[str, Any]) -> str:
        choices = event.get("choices") or []
        if not choices:
            return ""
        if self.endpoint == "chat":
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""


class _Failed(Exception):
    def __init__(self, outcome: Outcome, status: int | None, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status = status
        self.message = message


def _error_message(body: bytes) -> str:
    """OpenAI's `{"error": {"message": ...}}`, FastAPI's `{"detail": ...}`, or the raw text."""
    text = body.decode(errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed.get("detail"))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:500]
    return text[:500]
