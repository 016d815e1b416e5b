"""The floor benchmark (`benchmarks/bench_serve_floor.py`) on the shared e2e cluster: every row
runs every request through HAProxy (or Serve's proxy), the null ingress and, for the call rows,
the null engine, and the figures have their shape. No timing is asserted."""

from __future__ import annotations

import json
from urllib.parse import urlparse

import pytest

from benchmarks.bench_serve_floor import ROLES, ROWS, main

pytestmark = pytest.mark.serve


def test_every_row_runs_and_is_reported(serve_cluster, tmp_path, capsys):
    port = urlparse(serve_cluster["url"]).port
    argv = ["--requests", "16", "--warmup", "4", "--concurrency", "8", "--hold-s", "0.05",
            "--idle-s", "0.5", "--output-tokens", "16", "--port", str(port),
            "--out", str(tmp_path), "--name", "floor"]  # fmt: skip
    path = main(argv)
    assert path == tmp_path / "floor.md"
    result = json.loads(path.with_suffix(".json").read_text())
    assert [row["what"] for row in result["rows"]] == list(ROWS)  # every route answered 200
    for row in result["rows"]:
        assert row["requests"] == 16 and row["duration_s"] > 0
        parts = [row[f"{role}_ms_per_request"] for role in ROLES]
        assert min(parts) >= 0 and all(row[f"{role}_idle_cores"] >= 0 for role in ROLES)
        assert row["ms_per_request"] == pytest.approx(sum(parts))
        assert row["us_per_token"] == pytest.approx(1e3 * row["ms_per_request"] / 16)
    assert result["output_tokens"] == 16 and result["concurrency"] == 8
    # Each row is in the log as it ends (a device call may not bring the files back).
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert printed == result["rows"]
