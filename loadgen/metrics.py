"""Latency and throughput figures from request records: pure functions, no I/O.

Conventions follow the serving benchmarks people compare against (sglang's bench_serving,
vLLM's benchmark_serving): TTFT is the time to the first chunk with content, ITL the gaps between
chunks spread over the tokens each carries, TPOT = (E2E - TTFT) / (output tokens - 1) per
request, throughput counts successful requests over the run's duration (first send to last
completion), and goodput counts the successful requests that meet every SLO given.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from loadgen.records import RequestRecord

PERCENTILES = (50, 90, 99)
SLOWEST_TTFT = 8  # the slowest first tokens a summary lists


def chunk_token_counts(num_chunks: int, output_tokens: int) -> list[int]:
    """An estimate of how many tokens each content chunk carried, when the server reports only
    the total: the first chunk one token (a prefill yields one), the rest spread evenly, the
    remainder on the later chunks. Every chunk carries at least one token. Sums to
    max(output_tokens, num_chunks)."""
    if num_chunks == 0:
        return []
    if num_chunks == 1:
        return [max(output_tokens, 1)]
    rest = max(output_tokens - 1, num_chunks - 1)
    per_chunk, extra = divmod(rest, num_chunks - 1)
    later = [per_chunk + (i >= num_chunks - 1 - extra) for i in range(num_chunks - 1)]
    return [1, *later]


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """ITLs from the arrival times of content chunks and the tokens each carried: a chunk of k
    tokens that came `gap` after the previous one adds k latencies of gap / k, so a server that
    sends several tokens per chunk is not credited with a k-times-faster decode. The first
    chunk's tokens count toward TTFT and add none."""
    assert len(chunk_times) == len(chunk_tokens), (len(chunk_times), len(chunk_tokens))
    itl = []
    for prev, now, k in zip(chunk_times[:-1], chunk_times[1:], chunk_tokens[1:], strict=True):
        k = max(k, 1)
        itl.extend([(now - prev) / k] * k)
    return itl


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """Mean, P50, P90 and P99 in milliseconds (linear interpolation); None when empty."""
    values = np.asarray(list(values_s), dtype=float) * 1000.0
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if values.size == 0:
        return dict.fromkeys(keys)
    stats = [values.mean(), *np.percentile(values, PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, stats, strict=True)}


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None: no objective on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        """A successful request within every objective. A one-token output has no TPOT and so
        meets any TPOT objective."""
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict:
    """The run's figures: counts, throughputs (per second of `duration_s`), latency
    distributions in ms, goodput when `slo` has an objective, and the most frequent errors."""
    slo = slo or SLO()
    ok = [r for r in records if r.ok]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    input_tokens = sum(prompt_tokens) if len(prompt_tokens) == len(ok) else None
    outcomes = Counter(r.outcome.value for r in records)
    errors = Counter((r.status, r.error) for r in records if not r.ok)
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "outcomes": dict(sorted(outcomes.items())),
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "input_token_throughput": None if input_tokens is None else per_s(input_tokens),
        "total_output_tokens": output_tokens,
        "total_input_tokens": input_tokens,  # from usage; None if a server reported none
        # Little's law: the mean number of requests in flight.
        "mean_concurrency": per_s(sum(r.e2e_s for r in ok)),
        "ttft_ms": distribution_ms(r.ttft_s for r in ok),
        "itl_ms": distribution_ms(itl for r in ok for itl in r.itl_s),
        "tpot_ms": distribution_ms(r.tpot_s for r in ok if r.tpot_s is not None),
        "e2e_ms": distribution_ms(r.e2e_s for r in ok),
        # Until the request was on the wire (HTTP clients only; the TCP connect included).
        "write_ms": distribution_ms(r.written_s for r in ok if r.written_s is not None),
        "multi_token_chunk_share": _multi_token_chunk_share(ok),
        "slowest_ttft": slowest_ttft(ok),
        "errors": [
            {"status": status, "error": error, "count": count}
            for (status, error), count in errors.most_common(10)
        ],
    }
    if slo.any:
        good = sum(slo.met_by(r) for r in ok)
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        summary["goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(records) if records else None
    return summary


def slowest_ttft(records: Sequence[RequestRecord], count: int = SLOWEST_TTFT) -> list[dict]:
    """The `count` slowest first tokens, slowest first, with when each request was due (s from
    the run's start) and its prompt: a tail that clusters in time is a stall somewhere on the
    path; one at the run's start is a cold path; one spread out follows the prompts."""
    slow = sorted(
        (r for r in records if r.ttft_s is not None), key=lambda r: -cast(float, r.ttft_s)
    )
    return [
        {
            "scheduled_s": round(r.scheduled_s, 3),
            "ttft_ms": round(cast(float, r.ttft_s) * 1e3, 1),
            "input_len": r.input_len,
        }
        for r in slow[:count]
    ]


def per_adapter(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """By model name, most requested first: requests, failures, TTFT P50 and E2E P50 in ms, and
    output tokens of the successful ones."""
    by_model: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_model[r.model].append(r)
    table = {}
    for model, rs in sorted(by_model.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        ok = [r for r in rs if r.ok]
        table[model] = {
            "is_base": rs[0].is_base,
            "count": len(rs),
            "failed": len(rs) - len(ok),
            "ttft_p50_ms": distribution_ms(r.ttft_s for r in ok)["p50"],
            "e2e_p50_ms": distribution_ms(r.e2e_s for r in ok)["p50"],
            "output_tokens": sum(r.output_tokens for r in ok),
        }
    return table


def _multi_token_chunk_share(ok: Sequence[RequestRecord]) -> float | None:
    """The share of successful requests whose output came in fewer chunks than tokens."""
    if not ok:
        return None
    return sum(r.num_chunks < r.output_tokens for r in ok) / len(ok)
