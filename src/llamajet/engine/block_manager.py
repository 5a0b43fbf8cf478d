"""BlockManager: hands out KV-cache blocks from the runner's fixed pool.

A sequence's K/V live in fixed-size blocks (block_size token slots each)
listed in its block table; the attention kernel reads K/V through that
table, so blocks need not be contiguous. The free list is a deque: O(1) to
take and return a block.
"""

from __future__ import annotations

from collections import deque

from llamajet.errors import RequestError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # NOTE: a block id is either in _free or in exactly one block table.

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, table: list[int], num_tokens: int) -> None:
        """Grows `table` so it holds `num_tokens` token slots."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise RequestError(
                f"KV cache full: need {need} more blocks, {len(self._free)} free of {self.num_blocks}")
        for _ in range(max(need, 0)):
            table.append(self._free.popleft())

    def free(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()

    def slot(self, table: list[int], pos: int) -> int:
        """KV slot of the token at position `pos` of a sequence."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
