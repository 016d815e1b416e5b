"""What an engine replica asks of its engine between steps (`AsyncEngine.call`): module-level
functions of the engine, so that they pickle when the engine runs in a process of its own
(`replicas.engine_process`). No Ray: the engine process imports this module, not the
deployment's.

Each engine's `LedgerFollower` (its side of the fleet's adapter ledger) lives beside the engine,
in the process the engine runs in, and is touched only on the engine's thread, as the engine is.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from replicas.adapter_ledger import AdapterEntry, LedgerFollower
from replicas.engine import Engine
from replicas.engine_stats import EngineStats

_followers: weakref.WeakKeyDictionary[Engine, LedgerFollower] = weakref.WeakKeyDictionary()
_followers_lock = threading.Lock()  # engines of one process (tests) share the table


def follower(engine: Engine) -> LedgerFollower:
    """`engine`'s ledger follower, made on first use."""
    with _followers_lock:
        found = _followers.get(engine)
        if found is None:
            found = _followers[engine] = LedgerFollower()
        return found


def engine_info(engine: Engine) -> dict[str, Any]:
    """What the ingress needs of the model: `max_model_len`, `eos_token_ids`, `vocab_size`."""
    return {
        "max_model_len": engine.max_model_len,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "vocab_size": engine.spec.vocab_size,
    }


def read_engine(engine: Engine) -> tuple[EngineStats, int]:
    """The engine's stats, and the GPU slots requests hold."""
    return engine.stats(), engine.adapters.slots.num_held


SLOWEST_STEPS = 8  # the slowest steps a reading lists


def slowest_steps(
    engine: Engine, since_step: int, count: int = SLOWEST_STEPS
) -> list[dict[str, Any]]:
    """The `count` slowest of the steps after step number `since_step` (of the most recent
    STEP_LOG), slowest first: when each started (`time.monotonic()`), its batch, whether it
    waited on an adapter copy, and its host launch and whole times in ms. A stall that was a
    step shows here with its shape; one that was not leaves these at the usual step time."""
    timings = sorted(engine.step_timings(since_step), key=lambda t: -t.total_s)[:count]
    return [
        {
            "started": t.started,
            "num_tokens": t.num_tokens,
            "num_seqs": t.num_seqs,
            "gated": t.gated,
            "launch_ms": round(t.launch_s * 1e3, 2),
            "step_ms": round(t.total_s * 1e3, 2),
        }
        for t in timings
    ]


def load_adapter(
    engine: Engine,
    name: str,
    path: str,
    pinned: bool,
    load_id: str | None,
    version: int | None,
) -> None:
    """A broadcast load (`LedgerFollower.load`)."""
    follower(engine).load(engine, name, path, pinned, load_id, version)


def unload_adapter(engine: Engine, name: str, load_id: str | None, version: int | None) -> None:
    """A broadcast unload (`LedgerFollower.unload`)."""
    follower(engine).unload(engine, name, load_id, version)


def follow_ledger(
    engine: Engine, entries: dict[str, AdapterEntry]
) -> tuple[list[str], dict[str, str]]:
    """Catch up with the ledger's `entries`: the names changed here, and the names whose entry
    could not be applied with a reason new since the last catch-up (for the replica's log)."""
    ledger = follower(engine)
    before = dict(ledger.failures)
    changed = ledger.follow(engine, entries)
    new_failures = {
        name: reason for name, reason in ledger.failures.items() if before.get(name) != reason
    }
    return changed, new_failures
