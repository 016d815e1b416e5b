"""The adapter-read benchmark runs end to end on CPU (tiny model) and writes its table."""

import json
import sys

from benchmarks import bench_adapter_read


def test_smoke_writes_the_idle_and_contended_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_adapter_read", "--smoke", "--rank", "8",
                                      "--reads", "4", "--out", str(tmp_path)])
    bench_adapter_read.main()
    result = json.loads((tmp_path / "adapter_read_r8.json").read_text())
    cases = [r["case"] for r in result["rows"]]
    assert cases == ["phases, idle", "1 at once, beside a step loop",
                     "4 at once, beside a step loop"]
    assert all(r["read_ms"] > 0 and r["read_over_file_read"] > 0 for r in result["rows"])
    idle = result["rows"][0]
    assert idle["file_read_ms"] > 0 and idle["pack_ms"] > 0
    assert "tiny shape" in (tmp_path / "adapter_read_r8.md").read_text()
