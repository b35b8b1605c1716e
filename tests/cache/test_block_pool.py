from __future__ import annotations

import pytest

from kvloom.cache.block_pool import BlockPool, BlockPoolError


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.check_integrity({b: 1 for b in blocks})
    pool.incref(blocks[:1])
    pool.decref(blocks)
    assert pool.num_free_blocks == 3
    pool.check_integrity({blocks[0]: 1})
    pool.decref(blocks[:1])
    assert pool.num_free_blocks == 4
    pool.check_integrity({})


def test_over_allocation_and_double_free_are_caught() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.decref(blocks)
    with pytest.raises(BlockPoolError):
        pool.decref(blocks)
    with pytest.raises(BlockPoolError):
        pool.incref(blocks)


def test_integrity_detects_wrong_holder_count() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    with pytest.raises(BlockPoolError):
        pool.check_integrity({blocks[0]: 1})
