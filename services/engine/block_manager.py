"""KV block bookkeeping: a free list and reference counts. Pure CPU, no tensors."""
from __future__ import annotations

from collections import deque

from tandem.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks seq needs so that num_new_tokens more tokens have KV slots."""
        return max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.allocate(self.blocks_needed(seq, num_new_tokens)))

    def release(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
