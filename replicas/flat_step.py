"""One step's tokens laid out flat, as the model runner and the CUDA-graph replays take them."""

from __future__ import annotations

from dataclasses import dataclass


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
