"""Host CPU per delivered token (benchmarks/serve_cpu.py): read from the OS for a live process,
summed by role, the engine's in-step CPU taken out of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.serve_cpu import ServingProcess, cpu_per_token, cpu_seconds, tcp_counters

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


def test_a_process_cpu_time_grows_with_its_work_and_a_gone_one_reads_none():
    before = cpu_seconds(os.getpid())
    deadline = before + 0.05
    while cpu_seconds(os.getpid()) < deadline:  # burn 50 ms of CPU
        sum(i * i for i in range(10_000))
    assert cpu_seconds(os.getpid()) >= deadline
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert cpu_seconds(int(done.stdout)) is None


def test_microseconds_per_token_by_role_and_in_all():
    procs = [ServingProcess("proxy", 1), ServingProcess("ingress", 2),
             ServingProcess("ingress", 3), ServingProcess("engine", 4),
             ServingProcess("controller", 5), ServingProcess("ingress", 6)]  # fmt: skip
    before = {1: 1.0, 2: 2.0, 3: 0.5, 4: 10.0, 5: 0.0}  # 6 started after the first reading
    after = {1: 1.2, 2: 2.1, 3: 0.8, 4: 10.5, 5: 0.1, 6: 9.0}
    out = cpu_per_token(procs, before, after, tokens=1000, engine_step_cpu_s=0.3)
    us = out["us_per_token"]
    assert us["proxy"] == pytest.approx(200.0)
    assert us["ingress"] == pytest.approx(400.0)  # 2 and 3; 6 has no reading before
    assert us["engine"] == pytest.approx(500.0)
    assert us["engine outside steps"] == pytest.approx(200.0)
    assert us["serving processes"] == pytest.approx(1100.0)  # the controller is not summed
    assert us["controller (not summed)"] == pytest.approx(100.0)
    assert out["processes"] == {"proxy": 1, "ingress": 2, "engine": 1, "controller": 1}
    assert out["us_per_token_by_process"] == pytest.approx(
        {"proxy 1": 200.0, "ingress 1": 100.0, "ingress 2": 300.0, "engine 1": 500.0,
         "controller 1": 100.0}
    )  # fmt: skip
    assert cpu_per_token(procs, before, after, tokens=0)["us_per_token"]["proxy"] is None


def test_the_load_generator_is_shown_beside_the_serving_processes_not_summed():
    procs = [ServingProcess("proxy", 1)]
    out = cpu_per_token(procs, {1: 1.0}, {1: 1.5}, tokens=1000, client_cpu_s=0.25)
    assert out["us_per_token"]["load generator (not summed)"] == pytest.approx(250.0)
    assert out["us_per_token"]["serving processes"] == pytest.approx(500.0)
    without = cpu_per_token(procs, {1: 1.0}, {1: 1.5}, tokens=1000)["us_per_token"]
    assert "load generator (not summed)" not in without


def test_tcp_counters_read_the_kernels_tcpext_table(tmp_path):
    netstat = tmp_path / "netstat"
    netstat.write_text(
        "TcpExt: SyncookiesSent ListenOverflows ListenDrops TCPSynRetrans\n"
        "TcpExt: 0 7 9 12\n"
        "IpExt: InNoRoutes\n"
        "IpExt: 0\n"
    )
    assert tcp_counters(str(netstat)) == {
        "ListenOverflows": 7, "ListenDrops": 9, "TCPSynRetrans": 12,
    }  # fmt: skip
    assert tcp_counters(str(tmp_path / "absent")) == {}


def test_kill_9_returns_once_its_victim_has_exited(monkeypatch):
    """The chaos run times a kill from the victim's exit, not from the signal: a process still
    answers on its sockets until it has exited."""
    import random
    import subprocess
    import sys

    import benchmarks.bench_chaos as chaos
    from benchmarks.serve_cpu import ServingProcess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        victim = ServingProcess("ingress", child.pid, "actor-1")
        monkeypatch.setattr(chaos, "serving_processes", lambda *_: [victim])
        assert not chaos.exited(child.pid)
        assert chaos.kill_9("app", chaos.INGRESS, random.Random(0)) == victim
        assert chaos.exited(child.pid)  # a zombie until reaped: exited all the same
    finally:
        child.kill()
        child.wait()
    assert chaos.exited(child.pid)  # reaped: gone
