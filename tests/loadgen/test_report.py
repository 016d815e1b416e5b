"""The progress bar and the optional plot."""

from __future__ import annotations

import io
import sys

from loadgen.progress import TextBar
from loadgen.records import Outcome, RequestRecord
from loadgen.report import write_plot


def record(outcome: Outcome) -> RequestRecord:
    timings = {"ttft_s": 0.1, "e2e_s": 0.2, "output_tokens": 2} if outcome is Outcome.OK else {}
    error = None if outcome is Outcome.OK else "boom"
    return RequestRecord(0, "a", False, 1, 2, 0.0, outcome, error=error, **timings)


def test_text_bar_counts_ok_and_failed():
    out = io.StringIO()
    bar = TextBar(4, out=out)
    for outcome in (Outcome.OK, Outcome.OK, Outcome.HTTP_ERROR, Outcome.OK):
        bar.update(record(outcome))
    bar.close()
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("[" + "#" * TextBar.WIDTH + "] 4/4")
    assert "ok 3  failed 1" in last


def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert write_plot({"runs": []}, tmp_path / "p.png") is None
    assert not (tmp_path / "p.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err
