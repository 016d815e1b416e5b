"""Metrics on synthetic records: distributions, TPOT, ITL spreading, goodput, per adapter, and
the adapter-stats difference."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.metrics import (
    SLO,
    chunk_token_counts,
    distribution_ms,
    inter_token_latencies,
    per_adapter,
    summarize,
)
from loadgen.records import Outcome, RequestRecord
from loadgen.server_stats import numeric_diff


def ok(
    ttft: float, e2e: float, tokens: int, model: str = "a", scheduled_s: float = 0.0, **extra
) -> RequestRecord:
    return RequestRecord(
        index=0, model=model, is_base=False, input_len=10, output_len=tokens,
        scheduled_s=scheduled_s,
        outcome=Outcome.OK, sent_s=0.0, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
        num_chunks=tokens, **extra,
    )  # fmt: skip


def failed(model: str = "a", status: int | None = 404) -> RequestRecord:
    return RequestRecord(
        index=0, model=model, is_base=False, input_len=10, output_len=5, scheduled_s=0.0,
        outcome=Outcome.HTTP_ERROR, status=status, error="not found",
    )  # fmt: skip


class TestDistributions:
    def test_mean_and_percentiles_in_ms(self):
        d = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
        assert d["mean"] == pytest.approx(50.5)
        assert d["p50"] == pytest.approx(50.5)
        assert d["p90"] == pytest.approx(np.percentile(np.arange(1, 101), 90))
        assert d["p99"] == pytest.approx(99.01)

    def test_empty_is_none(self):
        assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


class TestPerRequest:
    def test_tpot_excludes_the_first_token(self):
        assert ok(ttft=0.1, e2e=0.5, tokens=5).tpot_s == pytest.approx(0.1)

    def test_one_token_has_no_tpot(self):
        assert ok(ttft=0.1, e2e=0.1, tokens=1).tpot_s is None

    def test_failed_records_need_a_reason_and_ok_ones_timings(self):
        with pytest.raises(AssertionError):
            RequestRecord(0, "a", False, 1, 1, 0.0, Outcome.HTTP_ERROR)
        with pytest.raises(AssertionError):
            RequestRecord(0, "a", False, 1, 1, 0.0, Outcome.OK, ttft_s=0.2, e2e_s=0.1)


class TestInterTokenLatencies:
    def test_one_token_per_chunk_gives_the_gaps(self):
        itl = inter_token_latencies([0.1, 0.2, 0.35], [1, 1, 1])
        assert itl == pytest.approx([0.1, 0.15])

    def test_multi_token_chunks_spread_their_gap(self):
        itl = inter_token_latencies([0.1, 0.4, 0.5], [1, 3, 1])
        assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
        assert sum(itl) == pytest.approx(0.5 - 0.1)  # ITLs add up to E2E - TTFT

    def test_counts_estimated_from_the_total(self):
        assert chunk_token_counts(3, 10) == [1, 4, 5]
        assert chunk_token_counts(4, 4) == [1, 1, 1, 1]
        assert chunk_token_counts(1, 7) == [7]
        assert chunk_token_counts(0, 0) == []
        assert chunk_token_counts(3, 2) == [1, 1, 1]  # never below one token per chunk

    @pytest.mark.parametrize("chunks, total", [(2, 9), (5, 33), (7, 7), (10, 11)])
    def test_estimated_counts_sum_to_the_total(self, chunks, total):
        counts = chunk_token_counts(chunks, total)
        assert sum(counts) == total and len(counts) == chunks and min(counts) >= 1


class TestSummary:
    def test_counts_and_throughput(self):
        records = [ok(0.1, 1.0, 10), ok(0.2, 1.0, 30), failed()]
        s = summarize(records, duration_s=2.0)
        assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
        assert s["request_throughput"] == pytest.approx(1.0)
        assert s["output_token_throughput"] == pytest.approx(20.0)
        assert s["mean_concurrency"] == pytest.approx(1.0)
        assert s["outcomes"] == {"http_error": 1, "ok": 2}
        assert s["errors"] == [{"status": 404, "error": "not found", "count": 1}]
        assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
        assert "goodput" not in s

    def test_input_tokens_only_when_every_request_reported_usage(self):
        with_usage = [ok(0.1, 1.0, 10, prompt_tokens=7), ok(0.1, 1.0, 10, prompt_tokens=5)]
        assert summarize(with_usage, 1.0)["total_input_tokens"] == 12
        partial = [*with_usage, ok(0.1, 1.0, 10)]
        assert summarize(partial, 1.0)["total_input_tokens"] is None

    def test_goodput_counts_requests_meeting_every_slo(self):
        records = [
            ok(ttft=0.05, e2e=0.5, tokens=10),  # TTFT 50 ms, TPOT 50 ms: meets both
            ok(ttft=0.30, e2e=0.6, tokens=10),  # TTFT too slow
            ok(ttft=0.05, e2e=2.0, tokens=10),  # TPOT too slow (216 ms)
            ok(ttft=0.05, e2e=0.05, tokens=1),  # no TPOT: meets the TPOT SLO
            failed(),
        ]
        s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=100, tpot_ms=60))
        assert s["goodput"] == pytest.approx(2 / 2.0)
        assert s["slo_attainment"] == pytest.approx(2 / 5)
        only_ttft = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=100))
        assert only_ttft["goodput"] == pytest.approx(3 / 2.0)

    def test_slowest_first_tokens_listed_slowest_first_with_when_they_were_due(self):
        records = [ok(0.01 * i, 1.0, 3, scheduled_s=0.5 * i) for i in range(12)]
        slow = summarize([*records, failed()], duration_s=6.0)["slowest_ttft"]
        assert [x["ttft_ms"] for x in slow] == [110.0, 100.0, 90.0, 80.0, 70.0, 60.0, 50.0, 40.0]
        assert [x["scheduled_s"] for x in slow[:2]] == [5.5, 5.0]
        assert slow[0]["input_len"] == 10

    def test_no_successes_leaves_latencies_empty(self):
        s = summarize([failed(), failed()], duration_s=1.0, slo=SLO(ttft_ms=1))
        assert s["completed"] == 0 and s["ttft_ms"]["p50"] is None and s["goodput"] == 0

    def test_slo_must_be_positive(self):
        with pytest.raises(ValueError):
            SLO(ttft_ms=0)


class TestPerAdapter:
    def test_count_failures_and_ttft_by_model_most_requested_first(self):
        records = [ok(0.1, 1, 3, "x"), ok(0.3, 1, 3, "x"), failed("x"), ok(0.2, 1, 3, "y")]
        table = per_adapter(records)
        assert list(table) == ["x", "y"]
        assert table["x"]["count"] == 3 and table["x"]["failed"] == 1
        assert table["x"]["ttft_p50_ms"] == pytest.approx(200.0)
        assert table["y"]["ttft_p50_ms"] == pytest.approx(200.0)


class TestNumericDiff:
    def test_numbers_and_nested_dicts(self):
        before = {"loads": 3, "hits": 1.5, "rank": 8, "state": "ok", "flag": True, "gone": 1}
        after = {"loads": 7, "hits": 2.0, "rank": 8, "state": "ok", "flag": False, "new": 4}
        assert numeric_diff(before, after) == {"loads": 4, "hits": 0.5}

    def test_lists_of_named_objects_line_up_by_name(self):
        before = {"adapters": [{"name": "a", "loads": 1}, {"name": "b", "loads": 2}]}
        after = {"adapters": [{"name": "b", "loads": 5}, {"name": "a", "loads": 1}]}
        assert numeric_diff(before, after) == {"adapters": {"b": {"loads": 3}}}

    def test_no_numeric_change_is_none(self):
        assert numeric_diff({"a": "x", "n": 2}, {"a": "y", "n": 2}) is None
        assert numeric_diff([1, 2], [1, 2, 3]) is None
