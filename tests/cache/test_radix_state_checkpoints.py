"""RadixCache's state checkpoints (a state-space model's prefix cache): a match ends at
the deepest checkpointed node, a split keeps the checkpoint at its end, trimming or
evicting a node frees it, and a checkpoint slot is taken from the least recently
used unlocked checkpoint when none is free. Expected values are worked out by hand."""

from __future__ import annotations

import pytest

from kvloom.cache.block_pool import BlockPool
from kvloom.cache.radix_cache import RadixCache, RadixCacheError

BS = 2
SLOTS = range(10, 12)  # two checkpoint slots, numbered after the requests' (as the engine does)


class Tree:
    """A cache holding token lists (whole blocks) on fresh blocks, and which blocks."""

    def __init__(self, *prefixes: list[int]) -> None:
        self.pool = BlockPool(32)
        self.cache = RadixCache(self.pool, BS, SLOTS)
        self._ids: dict[tuple[int, ...], int] = {}  # a block-aligned prefix -> its last block
        for tokens in prefixes:
            self.add(tokens)

    def add(self, tokens: list[int]) -> None:
        fresh = self.pool.allocate(len(tokens) // BS)
        for i, block in enumerate(fresh):
            self._ids.setdefault(tuple(tokens[: (i + 1) * BS]), block)
        self.cache.insert(tokens, self.block_ids(tokens))
        self.pool.decref(fresh)  # only the cache holds them

    def block_ids(self, tokens: list[int]) -> list[int]:
        return [self._ids[tuple(tokens[: (i + 1) * BS])] for i in range(len(tokens) // BS)]

    def checkpoint(self, tokens: list[int]) -> int:
        """Attach a checkpoint after ``tokens`` (cached); returns its slot."""
        slot = self.cache.reserve_state_slot()
        assert slot is not None
        self.cache.attach_state(self.cache.insert(tokens, self.block_ids(tokens)), slot)
        return slot


def test_a_match_ends_at_the_deepest_checkpoint() -> None:
    tree = Tree([1, 2, 3, 4, 5, 6, 7, 8])
    cache = tree.cache
    miss = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert (miss.num_tokens, miss.branch_tokens, miss.state_slot) == (0, 8, None)
    assert "checkpointed nowhere" in (miss.miss_reason or "")
    slot = tree.checkpoint([1, 2, 3, 4])
    hit = cache.match([1, 2, 3, 4, 5, 6, 9, 9])  # KV for 6 tokens, a state after 4
    assert (hit.num_tokens, hit.branch_tokens, hit.state_slot) == (4, 6, slot)
    assert hit.block_ids == tree.block_ids([1, 2, 3, 4])
    assert "only after 4 tokens" in (hit.miss_reason or "")
    assert cache.cached_prefix_length([1, 2, 3, 4, 5, 6, 9, 9]) == 4
    # No partial block: the state after a token inside a block is checkpointed nowhere.
    assert cache.match([1, 2, 3, 4, 5, 7]).partial is None
    assert cache.cached_prefix_length([1, 2, 3, 4, 5, 7]) == 4
    cache.check_integrity()


def test_a_split_keeps_the_checkpoint_at_the_lower_half() -> None:
    tree = Tree([1, 2, 3, 4, 5, 6])
    slot = tree.checkpoint([1, 2, 3, 4, 5, 6])
    tree.add([1, 2, 7, 8])  # splits the edge after [1, 2]
    assert tree.cache.match([1, 2, 3, 4, 5, 6, 0]).state_slot == slot
    assert tree.cache.match([1, 2, 7, 8, 0]).num_tokens == 0  # no checkpoint on that branch, nor at [1, 2]
    tree.cache.check_integrity()


def test_evicting_kv_frees_the_checkpoint_after_it() -> None:
    tree = Tree([1, 2, 3, 4])
    cache = tree.cache
    tree.checkpoint([1, 2, 3, 4])
    assert cache.evict(1) == 1  # trims [3, 4]: the state after [1, 2, 3, 4] no longer has its KV
    assert cache.num_cached_states == 0
    assert cache.match([1, 2, 3, 4, 0]).num_tokens == 0
    assert {cache.reserve_state_slot(), cache.reserve_state_slot()} == {10, 11}
    cache.check_integrity()


def test_a_reservation_evicts_the_least_recently_used_unlocked_checkpoint() -> None:
    tree = Tree([1, 1], [2, 2], [3, 3])
    cache = tree.cache
    first, second = tree.checkpoint([1, 1]), tree.checkpoint([2, 2])
    cache.match([1, 1, 0])  # [1, 1] is now the more recently used
    third = cache.reserve_state_slot()
    assert third == second  # [2, 2]'s went
    assert cache.match([2, 2, 0]).num_tokens == 0
    cache.attach_state(cache.insert([3, 3], tree.block_ids([3, 3])), third)
    on_three, on_one = cache.match([3, 3, 0]).handle, cache.match([1, 1, 0]).handle
    cache.lock(on_three)
    cache.lock(on_one)
    assert cache.reserve_state_slot() is None  # both checkpoints are on locked paths
    cache.unlock(on_three)
    assert cache.reserve_state_slot() == third != first
    cache.check_integrity()


def test_attaching_where_a_checkpoint_exists_frees_the_new_slot() -> None:
    tree = Tree([1, 2])
    cache = tree.cache
    kept = tree.checkpoint([1, 2])
    spare = cache.reserve_state_slot()
    assert spare is not None
    cache.attach_state(cache.match([1, 2, 0]).handle, spare)
    assert cache.match([1, 2, 0]).state_slot == kept and cache.num_cached_states == 1
    assert cache.reserve_state_slot() == spare
    cache.check_integrity()


def test_misuse_and_corruption_are_caught() -> None:
    tree = Tree([1, 2])
    cache = tree.cache
    with pytest.raises(RadixCacheError, match="released without being reserved"):
        cache.release_state_slot(10)
    with pytest.raises(RadixCacheError, match="attached without being reserved"):
        cache.attach_state(cache.insert([1, 2], tree.block_ids([1, 2])), 11)
    slot = tree.checkpoint([1, 2])
    cache._free_state_slots.append(slot)  # free and attached at once
    with pytest.raises(RadixCacheError, match="state checkpoint slots"):
        cache.check_integrity()
