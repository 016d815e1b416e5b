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


def scale_run(path, replicas, tok_s, per_replica, requests_a_replica=512, tail=None):
    rows = [{"stream": "1 adapter", "path": "http", "throughput_tok_s": tok_s,
             "requests_per_replica": per_replica, "busy_share": 0.8,
             "load_generator_cores": 0.5}]  # fmt: skip
    if tail is not None:  # a run that sampled its replicas' queues
        rows[0] |= {"delivery_tail_s": tail, "replica_busy_until_s": [9.0] * replicas}
    data = {"device": "cpu", "command": "x", "date": "d", "commit": "c", "replicas": replicas,
            "workload": {"requests": requests_a_replica * replicas}, "rows": rows}  # fmt: skip
    path.write_text(json.dumps(data))
    return str(path)


def test_scale_out_is_each_run_against_n_times_one_replica(tmp_path):
    runs = [scale_run(tmp_path / "1.json", 1, 1000.0, [512]),
            scale_run(tmp_path / "2.json", 2, 1800.0, [512, 512]),
            scale_run(tmp_path / "4.json", 4, 3000.0, [600, 400, 512, 536], tail=1.5)]  # fmt: skip
    md = serve_compare.main(["--name", "t", "--out", str(tmp_path), "--scale", ",".join(runs)])
    rows = json.loads(md.with_suffix(".json").read_text())["rows"]
    assert [r["HTTP / (N x one)"] for r in rows] == pytest.approx([1.0, 0.9, 0.75])
    assert [r["imbalance"] for r in rows] == pytest.approx([1.0, 1.0, 600 / 512])
    assert [r["delivery_tail_s"] for r in rows] == [None, None, 1.5]
    assert rows[2]["replica_busy_until_s"] == [9.0] * 4


def test_scale_out_needs_the_one_replica_run_first_and_equal_load(tmp_path, capsys):
    one = scale_run(tmp_path / "1.json", 1, 1000.0, [512])
    two = scale_run(tmp_path / "2.json", 2, 1800.0, [512, 512])
    with pytest.raises(SystemExit):
        serve_compare.main(["--name", "t", "--out", str(tmp_path), "--scale", f"{two},{one}"])
    assert "one-replica run" in capsys.readouterr().err
    light = scale_run(tmp_path / "2l.json", 2, 1800.0, [256, 256], requests_a_replica=256)
    with pytest.raises(SystemExit):
        serve_compare.main(["--name", "t", "--out", str(tmp_path), "--scale", f"{one},{light}"])
    assert "same requests a replica" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_compare.main(["--name", "t", "--out", str(tmp_path)])
    assert "--pair" in capsys.readouterr().err
