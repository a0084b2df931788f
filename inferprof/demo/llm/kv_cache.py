"""The LLM demo's KV cache: fixed-size blocks in one preallocated pool, as vLLM pages it.

Each layer holds a key pool and a value pool of ``num_blocks * block_size`` token slots.
A request owns a list of blocks (its block table); position ``p`` of the request lives
in slot ``blocks[p // block_size] * block_size + p % block_size``. Blocks are allocated
and freed whole, by :class:`BlockAllocator`, so the scheduler's budget is in blocks and
running out of them is what forces an eviction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockAllocator:
    """A free list of block ids. Not thread-safe: the engine thread owns it."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks, or None (nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count!r}")
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` positions."""
    return -(-tokens // block_size)


class KVCache:
    """Per-layer key and value pools addressed through a request's block table."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 head_dim: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, num_heads, head_dim)
        self._keys = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self._values = [np.zeros(shape, np.float32) for _ in range(num_layers)]

    def _slots(self, blocks: Sequence[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(blocks, dtype=np.int64)
        if end > len(table) * self.block_size:
            raise ValueError(f"{len(table)} blocks cannot hold {end} positions")
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, blocks: Sequence[int], start: int, keys: np.ndarray,
              values: np.ndarray) -> None:
        slots = self._slots(blocks, start, start + len(keys))
        self._keys[layer][slots] = keys
        self._values[layer][slots] = values

    def read(self, layer: int, blocks: Sequence[int], end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions ``0 .. end-1``, each ``(end, heads, head_dim)``."""
        slots = self._slots(blocks, 0, end)
        return self._keys[layer][slots], self._values[layer][slots]


__all__ = ["BlockAllocator", "KVCache", "blocks_for"]
