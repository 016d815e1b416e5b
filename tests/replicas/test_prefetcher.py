"""Prefetch ordering as properties of the plan, without torch."""

import math

import pytest

from replicas.adapters.prefetcher import Load, PrefetchQueue, SlotView


def view(free=0, resident=(), evictable=None):
    return SlotView(free, tuple(resident), frozenset(resident if evictable is None else evictable))


def test_soonest_need_is_loaded_first():
    q = PrefetchQueue()
    q.hint("late", 5.0)
    q.hint("soon", 1.0)
    q.hint("mid", 3.0)
    assert [load.adapter for load in q.plan(view(free=2), max_loads=8)] == ["soon", "mid"]


def test_resident_adapters_are_not_reloaded():
    q = PrefetchQueue()
    q.hint("a", 1.0)
    assert q.plan(view(free=1, resident=["a"]), 8) == []


def test_never_evicts_an_adapter_needed_sooner():
    q = PrefetchQueue()
    q.hint("busy-soon", 1.0)  # resident, needed at t=1
    q.hint("new", 2.0)
    plan = q.plan(view(resident=["busy-soon"]), 8)
    assert plan == []


def test_evicts_the_adapter_needed_last_and_lru_among_unneeded():
    q = PrefetchQueue()
    q.hint("new", 1.0)
    q.hint("x", 9.0)  # resident, needed late
    plan = q.plan(view(resident=["old-lru", "x", "old-mru"]), 1)
    assert plan == [Load("new", "old-lru")]  # never needed again beats needed later; LRU first
    q2 = PrefetchQueue()
    q2.hint("new", 1.0)
    q2.hint("x", 9.0)
    assert q2.plan(view(resident=["x"]), 1) == [Load("new", "x")]


def test_held_or_pinned_adapters_are_never_victims():
    q = PrefetchQueue()
    q.hint("new", 1.0)
    assert q.plan(view(resident=["held"], evictable=[]), 8) == []


def test_plan_respects_max_loads():
    q = PrefetchQueue()
    for i in range(5):
        q.hint(f"a{i}", float(i))
    assert len(q.plan(view(free=8), max_loads=2)) == 2


def test_queue_is_bounded_and_keeps_the_soonest():
    q = PrefetchQueue(capacity=2)
    q.hint("a", 5.0)
    q.hint("b", 1.0)
    q.hint("c", 3.0)  # evicts a (latest)
    q.hint("d", 9.0)  # later than everything kept: dropped
    assert [a for a, _ in q.ordered()] == ["b", "c"]
    q.hint("c", 0.5)  # an earlier hint for a queued adapter moves it up
    assert q.ordered()[0] == ("c", 0.5)
    assert q.due("zzz") == math.inf


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        PrefetchQueue(0)
