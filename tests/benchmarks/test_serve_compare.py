"""`benchmarks.serve_compare`: a variant's HTTP figures against its baseline run's."""

import json

import pytest

from benchmarks import serve_compare


def result(path, tok_s, in_process=None, digests=None):
    rows = [
        {"stream": "1 adapter", "path": "http", "throughput_tok_s": tok_s, "ttft_p50_ms": 40.0,
         "itl_p50_ms": 9.0, "step_ms": 8.0, "launch_ms": 1.5,
         "host_cpu_us_per_token": {"serving processes": 400.0}},
    ]  # fmt: skip
    if in_process is not None:
        rows.append(
            {"stream": "1 adapter", "path": "in-process", "throughput_tok_s": in_process,
             "ttft_p50_ms": 30.0, "itl_p50_ms": 7.0, "launch_ms": 1.0}
        )  # fmt: skip
    data = {"device": "cpu", "command": "x", "date": "d", "rows": rows, "digests": digests or {}}
    path.write_text(json.dumps(data))
    return path


def test_the_variant_is_measured_against_the_baselines_in_process_and_http(tmp_path):
    base = result(tmp_path / "base.json", 800.0, in_process=1000.0)
    variant = result(tmp_path / "variant.json", 950.0)
    md = serve_compare.main(["--name", "t", "--out", str(tmp_path), "--pair", f"{base}:{variant}"])
    (row,) = json.loads(md.with_suffix(".json").read_text())["rows"]
    assert row["variant HTTP / in-process"] == pytest.approx(0.95)
    assert row["baseline HTTP / in-process"] == pytest.approx(0.8)
    assert row["variant / baseline HTTP"] == pytest.approx(950 / 800)
    assert "| 1 | 1 adapter | 1000 | 800 | 950 | 0.95 | 0.8 |" in md.read_text()


def test_runs_of_different_requests_are_refused(tmp_path, capsys):
    base = result(tmp_path / "base.json", 800.0, in_process=1000.0, digests={"1 adapter": "a"})
    variant = result(tmp_path / "variant.json", 950.0, digests={"1 adapter": "b"})
    with pytest.raises(SystemExit):
        serve_compare.main(["--name", "t", "--out", str(tmp_path), "--pair", f"{base}:{variant}"])
    assert "same requests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_compare.main(["--name", "t", "--out", str(tmp_path), "--pair", str(base)])
    assert "BASELINE:VARIANT" in capsys.readouterr().err
