"""The prefill-step benchmark runs end to end on CPU (tiny model) and writes its table."""

import json
import sys

from benchmarks import bench_prefill_step


def test_smoke_writes_a_row_per_size_and_adapter(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_prefill_step", "--smoke", "--tokens", "8,32",
                                      "--repeats", "2", "--out", str(tmp_path)])
    bench_prefill_step.main()
    result = json.loads((tmp_path / "prefill_step.json").read_text())
    cases = [(r["tokens"], r["adapter"]) for r in result["rows"]]
    assert cases == [(8, "none"), (8, "rank 16"), (32, "none"), (32, "rank 16")]
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in result["rows"])
    assert "| 32 | rank 16 |" in (tmp_path / "prefill_step.md").read_text()
