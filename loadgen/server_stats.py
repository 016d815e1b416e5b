"""What the server says about its adapters (`GET /v1/adapters`) around a run, and what changed.

The route is optional and its shape is the server's own, so the difference is taken blindly: for
every number found at the same place before and after, after minus before, kept where it is not
zero (the snapshots themselves are kept beside it). Lists of objects that carry a `name` or `id`
are matched by it, so adapters that appear, vanish or reorder line up.
"""

from __future__ import annotations

from typing import Any

_KEYS = ("name", "id", "replica_id", "adapter", "model")


def numeric_diff(before: Any, after: Any) -> Any:
    """The numeric changes from `before` to `after`: a number for numbers (booleans are not
    numbers), a dict for dicts and keyed lists, a list for other lists of the same length, and
    None where nothing numeric changed. Keys present on one side only are left out."""
    if _is_number(before) and _is_number(after):
        return (after - before) or None
    if isinstance(before, list) and isinstance(after, list):
        keyed_before, keyed_after = _by_key(before), _by_key(after)
        if keyed_before is not None and keyed_after is not None:
            before, after = keyed_before, keyed_after
        elif len(before) == len(after):
            diffs = [numeric_diff(b, a) for b, a in zip(before, after, strict=True)]
            return diffs if any(d is not None for d in diffs) else None
        else:
            return None
    if isinstance(before, dict) and isinstance(after, dict):
        diffs = {k: numeric_diff(before[k], after[k]) for k in before if k in after}
        diffs = {k: d for k, d in diffs.items() if d is not None}
        return diffs or None
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _by_key(items: list) -> dict[str, Any] | None:
    """`items` as {key: item} when each is a dict with one of `_KEYS` (the same one, unique)."""
    if not items or not all(isinstance(x, dict) for x in items):
        return None
    for key in _KEYS:
        names = [x.get(key) for x in items]
        if all(isinstance(n, str) for n in names) and len(set(names)) == len(names):
            return dict(zip(names, items, strict=True))
    return None
