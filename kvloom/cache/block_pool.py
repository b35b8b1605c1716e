"""BlockPool: the free list and reference counts of the paged KV cache.

A block is a fixed number of token slots in every layer's K and V pool. Every holder
of a block (a running request, the prefix cache) owns one reference; a block returns
to the free list exactly when its count drops to zero. Nothing here touches tensors.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """An allocator invariant was violated: a bug, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse spreads writes over the pool; any order would be correct.
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, each with one reference. Callers check first."""
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise BlockPoolError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def decref(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks that reach zero become free."""
        for block_id in block_ids:
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise BlockPoolError(f"decref of free block {block_id}")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free.append(block_id)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + in use == total; free blocks have no references and appear once.

        ``expected_refs`` (block -> number of holders, from the caller's view of who
        holds what) must equal the counts exactly when given.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a block appears twice in the free list")
        for block_id, count in enumerate(self._ref_counts):
            if count < 0:
                raise BlockPoolError(f"block {block_id} has negative ref count {count}")
            if (count == 0) != (block_id in free):
                raise BlockPoolError(f"block {block_id}: ref count {count} but free={block_id in free}")
        if expected_refs is not None:
            for block_id, count in enumerate(self._ref_counts):
                if expected_refs.get(block_id, 0) != count:
                    raise BlockPoolError(
                        f"block {block_id}: ref count {count}, holders {expected_refs.get(block_id, 0)}"
                    )
