"""The hop log (`replicas.hop_log`) and its reader (`benchmarks.serve_hops`)."""

from __future__ import annotations

import datetime

import pytest

from benchmarks import serve_hops
from replicas import hop_log


def _proxy_line(request_id: str, end: float, duration_ms: float) -> str:
    stamp = datetime.datetime.fromtimestamp(end).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return (
        f"INFO {stamp} proxy 10.0.0.1 {request_id} -- POST /v1/completions 200 "
        f"{duration_ms:.1f}ms"
    )


def test_stamps_are_off_unless_the_environment_names_a_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(hop_log, "_folder", None)
    hop_log.stamp("engine_in", "r1")
    assert not hop_log.enabled()
    assert list(tmp_path.iterdir()) == []


def test_a_stamp_is_one_line_a_reader_joins_by_request(tmp_path, monkeypatch):
    monkeypatch.setattr(hop_log, "_folder", str(tmp_path / "hops"))
    monkeypatch.setattr(hop_log, "_file", None)
    hop_log.stamp("ingress_handler", "r1")
    hop_log.stamp("engine_in", "r1")
    hop_log.stamp("engine_in", "r2")
    hop_log.stamp("engine_in", "r1")  # a second stamp of a hop: the first one counts
    hop_log._file.close()
    requests = serve_hops.read_hops([tmp_path / "hops"])
    assert set(requests) == {"r1", "r2"}
    assert set(requests["r1"]) == {"ingress_handler", "engine_in"}
    assert requests["r1"]["ingress_handler"] <= requests["r1"]["engine_in"]


def test_the_table_splits_a_burst_by_hop(tmp_path):
    t0 = 1_800_000_000.0
    lines = []
    proxy = []
    for i in range(10):  # a burst: the proxy begins one every 10 ms, the ingress 1 s later
        rid = f"r{i}"
        begin = t0 + 0.01 * i
        proxy.append(_proxy_line(rid, begin + 2.0, 2000.0))
        lines += [f"ingress_asgi {rid} {begin + 1.0:.6f}", f"engine_in {rid} {begin + 1.1:.6f}"]
    lines.append(f"engine_in late {t0 + 30:.6f}")  # another burst, after a gap
    lines.append("malformed line")
    (tmp_path / "hops-1.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "proxy_10.0.0.1.log").write_text("\n".join(proxy) + "\n")
    serve_hops.main([str(tmp_path), "--min-burst", "5", "--out", str(tmp_path / "t.md")])
    requests = serve_hops.read_hops([tmp_path])
    for rid, begin in serve_hops.read_proxy_log([tmp_path]).items():
        requests[rid]["proxy"] = begin
    groups = serve_hops.bursts(requests, min_size=5)
    assert [len(g) for g in groups] == [10]
    table = serve_hops.hop_table(groups[0])
    gaps = table["gaps_s"]
    assert list(gaps) == ["proxy -> ingress_asgi", "ingress_asgi -> engine_in"]
    assert gaps["proxy -> ingress_asgi"]["p50"] == pytest.approx(1.0, abs=2e-3)
    assert gaps["ingress_asgi -> engine_in"]["max"] == pytest.approx(0.1, abs=2e-3)
    assert table["starts_s"]["proxy"]["q1"] == pytest.approx(0.09, abs=2e-3)
    text = (tmp_path / "t.md").read_text()
    assert "| proxy -> ingress_asgi | 1.000 |" in text
    assert (tmp_path / "t.json").exists()


def test_intake_figures_count_only_the_measured_burst():
    from benchmarks.bench_proxy_intake import figures

    t0 = 100.0
    arrivals = {"warm": 90.0} | {f"r{i}": t0 + 0.5 + 0.1 * i for i in range(5)}
    begins = {f"r{i}": t0 + 0.05 * i for i in range(5)}
    out = figures(t0, arrivals, begins, 5, cpu_s=0.01)
    assert out["forward_rate_req_s"] == pytest.approx(4 / 0.4)
    assert out["reached_ingress_first_s"] == pytest.approx(0.5)
    assert out["lag_max_s"] == pytest.approx(0.5 + 0.4 - 0.2)
    assert out["proxy_cpu_ms_per_request"] == pytest.approx(2.0)
    no_lines = figures(t0, arrivals, {}, 5, cpu_s=None)
    assert "lag_p50_s" not in no_lines and no_lines["proxy_cpu_ms_per_request"] is None
    with pytest.raises(RuntimeError, match="4 of 5"):
        figures(t0, {k: v for k, v in arrivals.items() if k != "r4"}, begins, 5, None)


BAD_INTAKE_ARGS = [["--requests", "1"], ["--warmup", "0"], ["--ingress-replicas", "0"],
                   ["--hold-s", "-1"]]  # fmt: skip


@pytest.mark.parametrize("argv", BAD_INTAKE_ARGS)
def test_intake_refuses_arguments_it_cannot_measure(argv, capsys):
    from benchmarks.bench_proxy_intake import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "--requests >= 2, --warmup >= 1" in capsys.readouterr().err
