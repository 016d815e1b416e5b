"""One step's tokens laid out flat, as the model runner and the CUDA-graph replays take them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.scheduler import ScheduledSeq


@dataclass(frozen=True)
class FlatStep:
    """One step's tokens laid out flat: per token (`ids`, `positions`, `slot_mapping`: flat KV
    cache index), per sequence (`q_starts` [B+1] offsets of its new tokens, `ctx_lens`,
    `tables`: KV blocks) and per LoRA segment (`seg_lens`, `seg_slots`: adapter tokens first,
    grouped by slot)."""

    ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    q_starts: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]
    seg_lens: list[int]
    seg_slots: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def table_rows(self) -> list[list[int]]:
        """Block tables padded with zeros to the longest: nothing reads past a context."""
        width = max(len(t) for t in self.tables)
        return [t + [0] * (width - len(t)) for t in self.tables]


def lay_out(seqs: Sequence[ScheduledSeq], block_size: int) -> tuple[list[int], FlatStep]:
    """A step's sequences in the runner's order (adapter sequences first, grouped by slot, then
    base-model ones) as a FlatStep; `order[k]` is the index in `seqs` of the k-th sequence."""
    order = sorted(range(len(seqs)), key=lambda i: _slot_key(seqs[i]))
    ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    q_starts = [0]
    ctx_lens: list[int] = []
    tables: list[list[int]] = []
    seg_lens: list[int] = []
    seg_slots: list[int] = []
    bs = block_size
    for i in order:
        seq = seqs[i]
        req = seq.request
        start, end = seq.start, seq.start + seq.num_new_tokens
        ids += req.token_slice(start, end)
        positions += range(start, end)
        slot_mapping += [req.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        q_starts.append(q_starts[-1] + seq.num_new_tokens)
        ctx_lens.append(end)
        tables.append(req.block_table)
        if req.slot is not None:
            if seg_slots and seg_slots[-1] == req.slot:
                seg_lens[-1] += seq.num_new_tokens
            else:
                seg_lens.append(seq.num_new_tokens)
                seg_slots.append(req.slot)
    step = FlatStep(ids, positions, slot_mapping, q_starts, ctx_lens, tables, seg_lens, seg_slots)
    return order, step


def _slot_key(seq: ScheduledSeq) -> tuple[int, int]:
    slot = seq.request.slot
    return (1, 0) if slot is None else (0, slot)
