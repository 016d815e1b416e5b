"""Host CPU time of the serving processes, from the OS's counters: Serve's proxy, each ingress
replica, each engine replica (and, from the engine's own count, the part of it spent outside
engine steps), read before and after a run and divided by the tokens it delivered.

Processes are found in Ray's actor table (actor class names `ProxyActor`, `HAProxyManager`,
`ServeReplica:<app>:<deployment>`), with an engine replica's engine process
(`AppArgs.engine_process`: a child it spawned) counted as engine and the `haproxy` processes
an HAProxyManager runs (Serve's HAProxy mode, `app.main.PROXY_ENV`) as proxy; their CPU time
is user + system from `/proc/<pid>/stat` (every thread of the process), so this reads
processes of this machine only (Linux). `tcp_counters` reads the host's TCP counters the same
way: connections a burst could not open in time wait in the kernel, before any serving process
sees them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ServingProcess:
    role: str  # "proxy", "ingress", "engine", "controller"
    pid: int
    actor_id: str = ""
    spawned: bool = False  # a process the actor started (an engine process, an haproxy)


def serving_processes(app_name: str, ingress: str, engine: str) -> list[ServingProcess]:
    """The live Serve actors of this cluster that serve `app_name`, with their roles."""
    from ray._private import state  # the GCS's actor table; the state API needs a dashboard

    roles = {
        "ProxyActor": "proxy",
        "HAProxyManager": "proxy",  # the haproxy processes it runs are found below
        "ServeController": "controller",
        f"ServeReplica:{app_name}:{ingress}": "ingress",
        f"ServeReplica:{app_name}:{engine}": "engine",
    }
    found = []
    for actor_id, actor in state.actors().items():
        role = roles.get(actor.get("ActorClassName"))
        if role is not None and actor.get("State") == "ALIVE" and actor.get("Pid"):
            found.append(ServingProcess(role, int(actor["Pid"]), actor_id))
    parents = {p.pid: p for p in found if p.role in ("engine", "proxy")}
    found += [ServingProcess(parents[parent].role, pid, parents[parent].actor_id, spawned=True)
              for pid, parent in _spawned(parents)]  # fmt: skip
    return sorted(found, key=lambda p: (p.role, p.pid))


# How a child of a serving actor shows in its command line: an engine replica's engine process
# (multiprocessing's spawn) and the HAProxy an HAProxyManager runs.
CHILD_MARKERS = (b"spawn_main", b"haproxy")


def _spawned(parents: Mapping[int, object]) -> list[tuple[int, int]]:
    """(pid, parent pid) of the processes that `parents` started (CHILD_MARKERS)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if parent not in parents:
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if any(marker in cmdline for marker in CHILD_MARKERS):
                out.append((int(entry.name), parent))
        except (OSError, ValueError):
            continue
    return out


def _stat_cpu(stat: str) -> float:
    """User + system CPU seconds from a `/proc/.../stat` line."""
    # The command name (field 2) may hold spaces; the fields after its closing paren are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_S


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), None if it is gone."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name (`comm`: Ray's, gRPC's and
    Python's threads are named), {} if it is gone."""
    out: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[name] = out.get(name, 0.0) + _stat_cpu(stat)
    return out


def busiest_threads(
    processes: list[ServingProcess],
    before: Mapping[int, Mapping[str, float]],
    after: Mapping[int, Mapping[str, float]],
    top: int = 6,
) -> dict[str, list[tuple[str, float]]]:
    """Per role, the thread names that used the most CPU seconds between two readings."""
    by_role: dict[str, dict[str, float]] = {}
    for p in processes:
        grown = by_role.setdefault(p.role, {})
        for name, seconds in after.get(p.pid, {}).items():
            grown[name] = grown.get(name, 0.0) + seconds - before.get(p.pid, {}).get(name, 0.0)
    return {
        role: sorted(((n, round(s, 3)) for n, s in grown.items()), key=lambda t: -t[1])[:top]
        for role, grown in by_role.items()
    }


def read_threads(processes: list[ServingProcess]) -> dict[int, dict[str, float]]:
    return {p.pid: thread_cpu_seconds(p.pid) for p in processes}


def read_all(processes: list[ServingProcess]) -> dict[int, float]:
    return {p.pid: s for p in processes if (s := cpu_seconds(p.pid)) is not None}


def cpu_per_token(
    processes: list[ServingProcess],
    before: Mapping[int, float],
    after: Mapping[int, float],
    tokens: int,
    engine_step_cpu_s: float = 0.0,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    """Microseconds of host CPU per delivered token, by role (summed over a role's processes)
    and in all; `engine outside steps` takes the engine threads' CPU inside steps
    (`engine_step_cpu_s`, from the replicas' stats over the same run) out of the engine's.
    `client_cpu_s`, the load generator's own CPU over the run, is shown beside them (not
    summed): one process, so near a core's worth it, not the app, is what limits the run.
    `us_per_token_by_process` has each process alone ("ingress 1", "ingress 2", ... in pid
    order); `processes` counts each role's processes."""
    by_role: dict[str, float] = {}
    by_process: dict[str, float | None] = {}
    counts: dict[str, int] = {}
    for p in processes:
        if p.pid in before and p.pid in after:
            grown = after[p.pid] - before[p.pid]
            by_role[p.role] = by_role.get(p.role, 0.0) + grown
            counts[p.role] = counts.get(p.role, 0) + 1
            by_process[f"{p.role} {counts[p.role]}"] = 1e6 * grown / tokens if tokens else None
    serving = {role: s for role, s in by_role.items() if role != "controller"}
    seconds = dict(serving)
    if "engine" in seconds:
        seconds["engine outside steps"] = max(0.0, seconds["engine"] - engine_step_cpu_s)
    seconds["serving processes"] = sum(serving.values())
    per_token = {k: (1e6 * s / tokens if tokens else None) for k, s in seconds.items()}
    if "controller" in by_role and tokens:
        per_token["controller (not summed)"] = 1e6 * by_role["controller"] / tokens
    if client_cpu_s is not None:
        seconds["load generator (not summed)"] = client_cpu_s
        per_token["load generator (not summed)"] = 1e6 * client_cpu_s / tokens if tokens else None
    return {
        "us_per_token": per_token,
        "us_per_token_by_process": by_process,
        "cpu_s": seconds,
        "processes": counts,
    }


# The kernel's counts of connections a listener could not take in time, and of the SYNs a
# client sent again (1 s, then 3 s later): a burst of new connections past a listen backlog
# waits here, before any serving process sees it.
TCP_COUNTERS = ("ListenOverflows", "ListenDrops", "TCPReqQFullDrop", "TCPSynRetrans")


def tcp_counters(path: str = "/proc/net/netstat") -> dict[str, int]:
    """TCP_COUNTERS from the host's (this network namespace's) `TcpExt` table; {} where there is
    none (not Linux)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:") and values.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return {k: int(table[k]) for k in TCP_COUNTERS if k in table}
    return {}
