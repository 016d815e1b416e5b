"""Paged KV cache bookkeeping: which fixed-size blocks each request owns. Plain Python.

The tensors themselves live in the model runner; this module only hands out block ids. A block
belongs to at most one request at a time; every block returns to the free list when its request
finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when more blocks are asked for than are free. Callers check `can_allocate` first."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV block {b} freed but not allocated")
            self._used.remove(b)
            self._free.append(b)

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend `block_table` in place so it covers `num_tokens` tokens. Returns False (and
        changes nothing) when there are not enough free blocks."""
        need = blocks_for(num_tokens, self.block_size) - len(block_table)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        block_table.extend(self.allocate(need))
        return True
