"""Faults under load: streaming traffic with random hang-ups, adapter load/unload churn, and a
`kill -9` of an engine replica and of the ingress replica, on a local Serve deployment (CPU).

    python -m benchmarks.bench_chaos --duration 120 --out benchmarks/results
    python -m benchmarks.bench_chaos --soak --duration 300 --out benchmarks/results

`--soak` kills nothing: streamed and whole (non-streamed) requests through several ingress
replicas (4 by default) and 2 engine replicas, clients hanging up at random, loads and unloads
in between. Its figure is `lost`: requests the fleet failed although no client hung up and
nothing died, which must be 0, with the fleet idle and every KV block and slot free after.

What must hold, and what is measured:
- every request ends: tokens and `[DONE]`, a clean error event or status, or the client's own
  hang-up; none hangs (a request still open after its timeout is a fault, `hung`);
- afterwards the fleet is whole again and idle: every engine replica answers, none runs or
  queues a request, every KV block is free and no GPU slot is held;
- no adapter name is wedged: the names churned can each be loaded and unloaded again, and every
  replica (the restarted one included) serves the same adapters by name;
- recovery times: from each kill to the next successful request, and to the fleet being whole.

`run_chaos` is the driver; tests/e2e/test_serve.py runs it for a few seconds on its own
deployment, this script for longer on one it builds (tiny Llama-shaped model, random weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_cpu import ServingProcess, serving_processes

ENGINE = "EngineDeployment"
INGRESS = "Ingress"
REQUEST_TIMEOUT_S = 60.0  # a request open longer than this counts as hung


@dataclass(frozen=True)
class ChaosPlan:
    """One chaos run. Kill times are fractions of `duration_s`."""

    models: tuple[str, ...]  # what the traffic asks for: the base model first, then adapters
    churn_path: str  # adapter folder loaded and unloaded under `churn_names`
    churn_names: tuple[str, ...] = ("churn-0", "churn-1", "churn-2")
    duration_s: float = 20.0
    clients: int = 6
    long_share: float = 0.15  # requests that would run for thousands of tokens
    long_max_tokens: int = 2000
    max_tokens: tuple[int, int] = (4, 32)
    hang_up_share: float = 0.3  # requests the client abandons after a few chunks
    kill_engine_at: float | None = 0.2
    kill_ingress_at: float | None = 0.55
    orphans: int = 2  # long streams started just before the ingress kill, left to the engines
    stream_share: float = 1.0  # requests streamed; the others are answered whole
    seed: int = 0


@dataclass
class Outcome:
    kind: str  # ok, hung_up, error_event:<type>, status:<code>, cut, transport:<exc>, hung
    started: float
    ended: float
    model: str
    detail: str = ""  # the start of an error answer's body

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass
class ChaosLog:
    outcomes: list[Outcome] = field(default_factory=list)
    churn: Counter = field(default_factory=Counter)  # "load:200", "unload:503", ...
    churn_errors: list[tuple[str, float, str]] = field(default_factory=list)  # 5xx: kind, t, body
    kills: dict[str, float] = field(default_factory=dict)  # what -> when (monotonic)
    whole_again: dict[str, float] = field(default_factory=dict)  # what -> when fleet recovered
    orphans: int = 0  # long streams running in an engine when the ingress was killed
    orphan_abort_s: float | None = None  # ingress kill -> its requests ended in the engines
    after: list[Outcome] = field(default_factory=list)  # one request a model once settled


# ---------------------------------------------------------------------------------------------
# Processes


EXIT_WAIT_S = 5.0  # how long kill_9 waits for its victim to have exited


def exited(pid: int) -> bool:
    """The process is gone or a zombie: it has exited and its sockets are closed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X")


def kill_9(app: str, deployment: str, rng: random.Random) -> ServingProcess:
    """SIGKILL one replica of `deployment`, found in Ray's actor table, and return once it has
    exited (a process with many threads takes tens of milliseconds to; until then it still
    answers on its sockets)."""
    role = {ENGINE: "engine", INGRESS: "ingress"}[deployment]
    found = serving_processes(app, INGRESS, ENGINE)
    replicas = [p for p in found if p.role == role and not p.spawned]  # the actors themselves
    if not replicas:
        raise RuntimeError(f"no process of {app}/{deployment} found")
    victim = rng.choice(replicas)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + EXIT_WAIT_S
    while not exited(victim.pid) and time.monotonic() < deadline:
        time.sleep(0.002)
    return victim


# ---------------------------------------------------------------------------------------------
# Traffic


async def one_request(
    client: httpx.AsyncClient,
    model: str,
    max_tokens: int,
    hang_up_after: int | None,
    first_chunk: asyncio.Event | None = None,
    stream: bool = True,
) -> Outcome:
    """One completion, streamed or answered whole, classified by how it ended. `first_chunk`
    is set when its first tokens arrive (the request is running in an engine). A whole answer
    is hung up on after `hang_up_after` tens of milliseconds."""
    body = {
        "model": model,
        "prompt": [5, 17, 200, 33],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        "temperature": 0,
    }
    started = time.monotonic()

    def outcome(kind: str, detail: str = "") -> Outcome:
        return Outcome(kind, started, time.monotonic(), model, detail)

    if not stream:
        return await whole_request(client, body, hang_up_after, outcome)
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return outcome(f"status:{r.status_code}", r.text[:200])
                chunks, finish, error, done = 0, None, None, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"].get("type") or "error"
                        continue
                    chunks += 1
                    if first_chunk is not None:
                        first_chunk.set()
                    for choice in event.get("choices", []):
                        finish = choice.get("finish_reason") or finish
                    if hang_up_after is not None and chunks >= hang_up_after and finish is None:
                        return outcome("hung_up")
        if error is not None:
            return outcome(f"error_event:{error}")
        return outcome("ok" if done and finish is not None else "cut")
    except TimeoutError:
        return outcome("hung")
    except httpx.HTTPError as e:
        return outcome(f"transport:{type(e).__name__}")


async def whole_request(client: httpx.AsyncClient, body: dict, hang_up_after: int | None, outcome):
    """A non-streamed completion: `ok` when its answer has every token it asked for."""
    post = asyncio.ensure_future(client.post("/v1/completions", json=body))
    if hang_up_after is not None:
        done, _ = await asyncio.wait([post], timeout=0.01 * hang_up_after)
        if not done:
            post.cancel()  # the connection closes: the server aborts the request
            try:
                await post
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            return outcome("hung_up")
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            r = await post
    except TimeoutError:
        return outcome("hung")
    except httpx.HTTPError as e:
        return outcome(f"transport:{type(e).__name__}")
    if r.status_code != 200:
        return outcome(f"status:{r.status_code}", r.text[:200])
    usage = r.json().get("usage", {})
    if usage.get("completion_tokens") != body["max_tokens"]:
        return outcome("cut", r.text[:200])
    return outcome("ok")


async def client_loop(
    url: str, plan: ChaosPlan, rng: random.Random, stop_at: float, log: ChaosLog
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < stop_at:
            long = rng.random() < plan.long_share
            max_tokens = plan.long_max_tokens if long else rng.randint(*plan.max_tokens)
            hang_up = rng.randint(1, 4) if (long or rng.random() < plan.hang_up_share) else None
            stream = long or rng.random() < plan.stream_share
            model = rng.choice(plan.models)
            outcome = await one_request(client, model, max_tokens, hang_up, None, stream)
            log.outcomes.append(outcome)
            if not outcome.ok and outcome.kind != "hung_up":
                await asyncio.sleep(0.1)  # a failing fleet: don't spin


async def churn_loop(url: str, plan: ChaosPlan, rng: random.Random, stop_at: float, log: ChaosLog):
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < stop_at:
            name = rng.choice(plan.churn_names)
            for route, body in (
                ("load", {"lora_name": name, "lora_path": plan.churn_path}),
                ("unload", {"lora_name": name}),
            ):
                try:
                    r = await client.post(f"/v1/{route}_lora_adapter", json=body)
                    log.churn[f"{route}:{r.status_code}"] += 1
                    if r.status_code >= 500:
                        kind = f"{route}:{r.status_code}"
                        log.churn_errors.append((kind, time.monotonic(), r.text[:200]))
                except httpx.HTTPError as e:
                    log.churn[f"{route}:{type(e).__name__}"] += 1
                await asyncio.sleep(rng.uniform(0.05, 0.3))


async def kill_loop(
    url: str, app: str, plan: ChaosPlan, rng: random.Random, t0: float, log: ChaosLog
) -> None:
    """Kill each deployment's replica at its time. Before the ingress, start `plan.orphans`
    long streams and wait for the engines to run them; after it, time how long the engines take
    to end them (`log.orphan_abort_s`)."""
    kills = [(plan.kill_engine_at, ENGINE), (plan.kill_ingress_at, INGRESS)]
    orphans: list[asyncio.Task] = []
    for at, deployment in sorted((k for k in kills if k[0] is not None), key=lambda k: k[0]):
        await asyncio.sleep(max(0.0, t0 + at * plan.duration_s - time.monotonic()))
        if deployment == INGRESS and plan.orphans:
            running = [asyncio.Event() for _ in range(plan.orphans)]
            orphans = [asyncio.create_task(orphan(url, plan, log, e)) for e in running]
            try:  # each has its first tokens: it runs in an engine
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 30.0)
            except TimeoutError:
                pass
            log.orphans = sum(e.is_set() for e in running)
        dead = (await asyncio.to_thread(kill_9, app, deployment, rng)).actor_id
        killed = log.kills[deployment] = time.monotonic()
        killed_wall = time.time()
        if deployment == INGRESS and log.orphans:
            while time.monotonic() < killed + 30.0:
                stats = await fleet_stats(app)
                if stats and all(dead not in s.get("callers", {}) for s in stats):
                    # Every request of the dead ingress ended in the engines (its lease lapsed and
                    # the GCS said dead; over Ray actor calls a cancelled stream may end them
                    # first): when, by the engines' own clock (reading the stats under load lags).
                    ended = [s["caller_done_at"][dead] for s in stats
                             if dead in s.get("caller_done_at", {})]  # fmt: skip
                    if ended:
                        log.orphan_abort_s = max(ended) - killed_wall
                        break
                await asyncio.sleep(0.05)
    await asyncio.gather(*orphans)


async def orphan(url: str, plan: ChaosPlan, log: ChaosLog, running: asyncio.Event) -> None:
    """A long stream left running when the ingress dies; sent again (a few times) while it
    fails before its first tokens, e.g. when routed to an engine replica just killed."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        model, max_tokens = plan.models[0], plan.long_max_tokens
        for _ in range(5):
            log.outcomes.append(await one_request(client, model, max_tokens, None, running))
            if running.is_set():
                return
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# The fleet


def engine_handle(app: str):
    from ray import serve

    return serve.get_deployment_handle(ENGINE, app_name=app)


async def fleet_stats(app: str, timeout_s: float = 5.0) -> list[dict]:
    """`stats()` of every engine replica that answers."""
    try:
        answers = (
            await engine_handle(app)
            .broadcast("stats")
            .results_async(timeout_s=timeout_s, return_exceptions=True)
        )
    except Exception:
        return []
    return [a for a in answers if isinstance(a, dict)]


async def http_up(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


async def monitor_loop(url: str, app: str, num_engines: int, stop: asyncio.Event, log: ChaosLog):
    """Looks at the fleet every 0.5 s; records when it is whole again after each kill."""
    async with httpx.AsyncClient(base_url=url) as client:
        while not stop.is_set():
            engines = len(await fleet_stats(app, timeout_s=2.0))
            up = await http_up(client)
            now = time.monotonic()
            for what, killed in log.kills.items():
                whole = up and engines >= num_engines
                if what not in log.whole_again and whole and now > killed + 0.5:
                    log.whole_again[what] = now
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def settle(url: str, app: str, num_engines: int, timeout_s: float) -> dict[str, Any]:
    """Wait for the fleet to be whole and idle: every engine replica answers and runs nothing,
    all KV blocks free, no slot held. Returns the last stats and whether it settled."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url) as client:
        while True:
            stats = await fleet_stats(app)
            idle = len(stats) >= num_engines and all(
                s["num_running"] == s["num_waiting"] == s["num_held_slots"] == 0
                and s["num_free_kv_blocks"] == s["num_kv_blocks"]
                for s in stats
            )
            if idle and await http_up(client):
                return {"settled": True, "stats": stats}
            if time.monotonic() > deadline:
                return {"settled": False, "stats": stats}
            await asyncio.sleep(0.25)


async def requests_after(url: str, plan: ChaosPlan, log: ChaosLog) -> None:
    """One short streamed request a model once the fleet settled: it serves every model again.
    On a loaded machine the last kill's recovery can outlast the traffic, so these are what
    shows it came back (`log.after`)."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        for model in plan.models:
            log.after.append(await one_request(client, model, 4, None))


async def adapter_problems(url: str, app: str, plan: ChaosPlan) -> list[str]:
    """Where load, unload and the listings disagree, as sentences (empty: none). Every churn
    name ends unloaded and each can be loaded and unloaded again."""
    problems: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        for name in plan.churn_names:
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if unload.status_code not in (200, 404):
                problems.append(f"unload {name}: {unload.status_code} {unload.text[:200]}")
            load = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": plan.churn_path}
            )
            again = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if (load.status_code, again.status_code) != (200, 200):
                problems.append(
                    f"{name} is wedged: load {load.status_code} {load.text[:200]}, "
                    f"unload {again.status_code} {again.text[:200]}"
                )
        models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
        listing = (await client.get("/v1/adapters")).json()
    stray = models & set(plan.churn_names)
    if stray:
        problems.append(f"/v1/models still lists {sorted(stray)}")
    for card in listing["data"]:
        if card["id"] in plan.churn_names:
            problems.append(f"/v1/adapters still lists {card['id']}")
    served = await engine_handle(app).broadcast("served_adapters").results_async(timeout_s=30)
    views = {json.dumps(s["adapters"], sort_keys=True) for s in served}
    if len(views) != 1:
        problems.append(f"replicas serve different adapters: {sorted(views)}")
    return problems


async def run_chaos(url: str, app: str, plan: ChaosPlan, num_engines: int) -> dict[str, Any]:
    """Run `plan` against the app `app` behind `url`; returns the report (see `summarize`)."""
    rng = random.Random(plan.seed)
    log = ChaosLog()
    before = await fleet_stats(app)
    t0 = time.monotonic()
    stop_at = t0 + plan.duration_s
    stop = asyncio.Event()
    monitor = asyncio.create_task(monitor_loop(url, app, num_engines, stop, log))
    workers = [
        client_loop(url, plan, random.Random(rng.random()), stop_at, log)
        for _ in range(plan.clients)
    ]
    workers.append(churn_loop(url, plan, random.Random(rng.random()), stop_at, log))
    workers.append(kill_loop(url, app, plan, random.Random(rng.random()), t0, log))
    await asyncio.gather(*workers)
    traffic_end = time.monotonic()
    settled = await settle(url, app, num_engines, timeout_s=120.0)
    settled_s = time.monotonic() - traffic_end
    stop.set()
    await monitor
    await requests_after(url, plan, log)
    problems = await adapter_problems(url, app, plan)
    return summarize(plan, log, before, settled, settled_s, problems, t0)


def summarize(
    plan: ChaosPlan,
    log: ChaosLog,
    before: list[dict],
    settled: dict[str, Any],
    settled_s: float,
    problems: list[str],
    t0: float,
) -> dict[str, Any]:
    """The report: requests by how they ended, recovery per kill, the fleet after."""
    kinds = Counter(o.kind for o in log.outcomes)
    recovery: dict[str, dict[str, float | None]] = {}
    for what, killed in log.kills.items():
        later = [o.ended for o in log.outcomes + log.after if o.ok and o.started >= killed]
        whole = log.whole_again.get(what)
        recovery[what] = {
            "killed_at_s": killed - t0,
            "first_ok_after_s": min(later) - killed if later else None,
            "fleet_whole_after_s": whole - killed if whole is not None else None,
        }
    after = settled["stats"]
    ingress_killed = log.kills.get(INGRESS)
    unclean = [
        {"kind": o.kind, "started_s": o.started - t0, "ended_s": o.ended - t0}
        for o in log.outcomes
        if o.kind == "cut" or o.kind.startswith("transport:")
    ]
    server_errors = [
        {"kind": o.kind, "at_s": o.ended - t0, "body": o.detail}
        for o in log.outcomes
        if o.kind.startswith("status:5")
    ] + [{"kind": kind, "at_s": t - t0, "body": body} for kind, t, body in log.churn_errors]
    return {
        "duration_s": plan.duration_s,
        "requests": len(log.outcomes),
        "served": kinds["ok"],
        "outcomes": dict(sorted(kinds.items())),
        "errors": {k: v for k, v in sorted(kinds.items()) if k not in ("ok", "hung_up")},
        "hung": kinds["hung"],
        # Requests that ended other than complete or hung up on by their client: with nothing
        # killed, each is one the fleet lost.
        "lost": sum(v for k, v in kinds.items() if k not in ("ok", "hung_up")),
        "churn": dict(sorted(log.churn.items())),
        # first_ok_after_s counts the requests after the traffic too (`requests_after`).
        "recovery": recovery,
        "settled": settled["settled"],
        "settle_s": settled_s,
        "after_settle": dict(sorted(Counter(o.kind for o in log.after).items())),
        "engines_after": len(after),
        "aborted": total(after, "num_aborted") - total(before, "num_aborted"),
        "abandoned": total(after, "num_abandoned") - total(before, "num_abandoned"),
        "orphans": log.orphans,
        "orphan_abort_s": log.orphan_abort_s,
        "ingress_killed_s": None if ingress_killed is None else ingress_killed - t0,
        # Streams cut without [DONE]: those the dead ingress was sending when it died.
        "unclean": unclean,
        # Every 5xx, when and what it said: which fault each came from.
        "server_errors": server_errors,
        "problems": problems,
    }


def total(stats: list[dict], key: str) -> int:
    return sum(int(s.get(key, 0)) for s in stats)


# ---------------------------------------------------------------------------------------------
# The script


# A soak: nothing killed, half the requests answered whole.
SOAK = {"kill_engine_at": None, "kill_ingress_at": None, "orphans": 0, "stream_share": 0.5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas")
    p.add_argument("--ingress", type=int, help="ingress replicas (default: 1, or 4 with --soak)")
    p.add_argument("--soak", action="store_true", help="no kills; streamed and whole requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", help="results file name (default: chaos, or soak with --soak)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    import ray
    from ray import serve

    from app.main import CONTROLLER_OPTIONS, build_app
    from benchmarks.common import append_table, free_port, wait_healthy, write_results
    from replicas.models.spec import ModelSpec
    from synthetic.adapters import write_fleet
    from synthetic.models import write_model
    from synthetic.presets import TINY

    args = parse_args(argv)
    ingress = args.ingress or (4 if args.soak else 1)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    model_dir = write_model(work, TINY)
    (work / "adapters").mkdir()
    adapters = write_fleet(work / "adapters", ModelSpec.from_dir(model_dir), ["a", "b", "c"], 8)
    port = free_port()
    app = "chaos"
    ray.init(num_cpus=args.replicas + ingress + 1, include_dashboard=False)
    serve.start(
        http_options={"host": "127.0.0.1", "port": port}, controller_options=CONTROLLER_OPTIONS
    )
    url = f"http://127.0.0.1:{port}"
    try:
        serve.run(
            build_app(
                {
                    "model": str(model_dir),
                    "served_model_name": "base",
                    "load_format": "dummy",
                    "adapters": {name: adapters[name] for name in ("a", "b")},
                    "runtime_adapter_dirs": [str(work / "adapters")],
                    "device": "cpu",
                    "num_replicas": args.replicas,
                    "num_ingress_replicas": ingress,
                    "max_loras_per_batch": 2,
                    "max_lora_rank": 8,
                    "max_model_len": 4096,
                }
            ),
            name=app,
            route_prefix="/",
        )
        wait_healthy(url)
        plan = ChaosPlan(
            models=("base", "a", "b"),
            churn_path=adapters["c"],
            duration_s=args.duration,
            clients=args.clients,
            seed=args.seed,
            **(SOAK if args.soak else {}),
        )
        report = asyncio.run(run_chaos(url, app, plan, args.replicas))
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.soak:
        path = write_soak(args, ingress, report)
    else:
        rows = [{"kill": what, **figures} for what, figures in report["recovery"].items()]
        path = write_results(
            args.out,
            args.name or "chaos",
            "Faults under load (CPU, tiny model)",
            "kill -9 of an engine replica and of the ingress during streaming traffic with "
            "hang-ups and adapter churn; recovery = time from the kill to the next successful "
            "request, and to every replica answering again",
            ["kill", "killed_at_s", "first_ok_after_s", "fleet_whole_after_s"],
            rows,
            extra={k: v for k, v in report.items() if k != "recovery"},
        )
    outcome_rows = [{"outcome": k, "requests": v} for k, v in report["outcomes"].items()]
    append_table(path, "Requests by how they ended", ["outcome", "requests"], outcome_rows)
    print(path.read_text())
    return path


def write_soak(args: argparse.Namespace, ingress: int, report: dict[str, Any]) -> Path:
    from benchmarks.common import write_results

    figures = {
        "ingress replicas": ingress,
        "engine replicas": args.replicas,
        "seconds of traffic": args.duration,
        "requests": report["requests"],
        "served": report["served"],
        "hung up by their client": report["outcomes"].get("hung_up", 0),
        "lost by the fleet": report["lost"],
        "aborted as abandoned by a dead caller": report["abandoned"],
        "server errors (5xx)": len(report["server_errors"]),
        "fleet idle after, every KV block and slot free": report["settled"],
        "adapter churn answers": sum(report["churn"].values()),
    }
    return write_results(
        args.out,
        args.name or "soak",
        "Soak: nothing killed, several ingress replicas (CPU, tiny model)",
        "requests lost by the fleet against 0: every request completes unless its client hangs "
        "up; streamed and whole requests, random hang-ups, adapter loads and unloads in between",
        ["figure", "value"],
        [{"figure": k, "value": v} for k, v in figures.items()],
        extra={k: v for k, v in report.items() if k != "recovery"},
    )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
