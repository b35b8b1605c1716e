"""The KV cache manager under a sliding window in every layer: a request lets go of the
blocks its window has passed once its prompt is computed, the prefix cache keeps what it
indexed before that and is unpinned once the window passes it too, and every count is
the hand-computed one (blocks of 4 tokens, a window of 8 keys: the query at position p
reads keys p - 7 .. p, so block i is dead once p - 7 >= 4 (i + 1))."""

from __future__ import annotations

import pytest

from kvloom.cache.block_pool import BlockPool, BlockPoolError
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.radix_cache import RadixCache
from kvloom.engine.admission import AdmissionLimits
from kvloom.kv_spec import KVExport
from kvloom.request import NO_BLOCK, Request
from kvloom.sampling_params import SamplingParams

BS, WINDOW = 4, 8


def manager(num_blocks: int = 16, window: int = WINDOW) -> KVCacheManager:
    pool = BlockPool(num_blocks)
    return KVCacheManager(pool, BS, RadixCache(pool, BS), window=window)


def prefill(kv: KVCacheManager, prompt: list[int]) -> Request:
    request = Request(str(prompt), list(prompt), SamplingParams(max_tokens=100))
    prefix = kv.match_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return request


def decode(kv: KVCacheManager, request: Request, live: list[Request]) -> None:
    """One decode step: its slot, then the sampled token appended and the step's token computed."""
    assert kv.allocate_slots(request, 1)
    request.append_output_token(7)
    request.num_computed_tokens += 1
    kv.cache_computed_blocks(request)
    kv.check_integrity(live)


def test_blocks_behind_the_window_are_let_go_as_it_moves() -> None:
    kv = manager()
    request = prefill(kv, list(range(1, 11)))  # 10 tokens: blocks 0 and 1 full, indexed
    assert kv.num_held_blocks(request) == 3 and kv.pool.num_free_blocks == 13
    held, dropped, evictable = [], [], []
    for _ in range(12):  # computes the tokens at positions 10 .. 21
        decode(kv, request, [request])
        held.append(kv.num_held_blocks(request))
        dropped.append(request.block_ids.count(NO_BLOCK))
        evictable.append(kv.prefix_cache.num_evictable_blocks)
    # The step at position p lets go of (p - 7) // 4 blocks: 0 at p = 10, 1 from 11, 2 from 15, 3 from 19.
    assert dropped == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    # Held: every block up to p's, less those let go (p = 12, 16, 20 each start a block).
    assert held == [3, 2, 3, 3, 3, 2, 3, 3, 3, 2, 3, 3]
    # Blocks 0 and 1 stay in the cache, pinned, until the window has passed both (p = 15);
    # block 2, full at p = 11, was never indexed: the request stopped indexing at p = 11.
    assert evictable == [0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2]
    assert kv.prefix_cache.num_cached_blocks == 2
    assert kv.num_window_freed_blocks == 3
    assert request.block_ids[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in request.block_ids[3:]
    # Free: the held blocks go back; the cached prompt stays, now evictable.
    kv.free(request)
    kv.check_integrity([])
    assert kv.pool.num_free_blocks == 14 and kv.prefix_cache.num_evictable_blocks == 2


def test_a_prompt_longer_than_the_window_is_held_whole_until_computed() -> None:
    """Prefill keeps (and indexes) every prompt block: a later request with the same long
    prompt hits all of it; the first decode step then lets go of the dead ones at once."""
    kv = manager()
    prompt = list(range(1, 21))  # 20 tokens: 5 full blocks
    request = prefill(kv, prompt)
    assert kv.num_held_blocks(request) == 5 and kv.prefix_cache.num_cached_blocks == 5
    decode(kv, request, [request])  # position 20: (20 - 7) // 4 = 3 blocks dead
    assert request.block_ids.count(NO_BLOCK) == 3 and kv.num_held_blocks(request) == 3
    other = Request("other", prompt + [99], SamplingParams())
    hit = kv.match_prefix(other)
    assert hit.num_tokens == 20 and hit.block_ids == kv.prefix_cache.match(prompt).block_ids
    assert kv.prefix_cache.num_evictable_blocks == 0  # still pinned: the window has not passed block 4
    for _ in range(7):  # positions 21 .. 27: at 27, (27 - 7) // 4 = 5 blocks dead, the path's end passed
        decode(kv, request, [request])
    assert kv.prefix_cache.num_evictable_blocks == 5
    kv.free(request)
    kv.check_integrity([])


def test_a_request_staging_its_prompt_keeps_its_blocks() -> None:
    kv = manager()
    request = prefill(kv, list(range(1, 21)))
    request.kv_transfer = KVExport()
    decode(kv, request, [request])
    assert NO_BLOCK not in request.block_ids and kv.num_window_freed_blocks == 0
    kv.free(request)
    kv.check_integrity([])


def test_without_a_window_nothing_is_let_go() -> None:
    kv = manager(window=0)
    request = prefill(kv, list(range(1, 11)))
    for _ in range(12):
        decode(kv, request, [request])
    assert NO_BLOCK not in request.block_ids and kv.num_held_blocks(request) == 6
    with pytest.raises(ValueError, match="window must be 0"):
        manager(window=-1)


def test_speculative_rollback_and_preemption_keep_the_counts() -> None:
    """Blocks that held only rejected drafts go back past the let-go ones; a preempted
    request frees what it holds and starts again with a whole prompt."""
    kv = manager()
    request = prefill(kv, list(range(1, 11)))
    for _ in range(6):
        decode(kv, request, [request])  # computed: 16 tokens, 2 blocks let go
    assert kv.allocate_slots(request, 9)  # a verification of 8 drafts: positions 16 .. 24
    assert len(request.block_ids) == 7 and request.block_ids.count(NO_BLOCK) == 2
    request.append_output_token(7)
    request.num_computed_tokens += 1  # no draft accepted
    assert kv.release_uncomputed(request) == 2  # blocks 5 and 6 held only drafts
    kv.check_integrity([request])
    free_before = kv.pool.num_free_blocks
    kv.free(request)
    assert kv.pool.num_free_blocks == free_before + 3  # blocks 2, 3, 4
    request.num_computed_tokens = 0
    kv.check_integrity([request])
    hit = kv.match_prefix(request)
    assert hit.num_tokens == 8  # the prompt's two indexed blocks
    assert kv.allocate_slots(request, request.num_tokens - 8, hit)
    kv.check_integrity([request])


def test_the_integrity_check_finds_a_block_let_go_inside_the_window() -> None:
    kv = manager()
    request = prefill(kv, list(range(1, 11)))
    decode(kv, request, [request])  # 11 computed: the next query (position 11) reads keys 4 .. 11
    kv._cache_state[request].num_dropped = 2  # block 1 (keys 4 .. 7) let go as well
    kv.pool.decref(request.block_ids[:2])
    request.block_ids[:2] = [NO_BLOCK, NO_BLOCK]
    with pytest.raises(BlockPoolError, match="let go of 2 blocks its window of 8 keys at token 11 still reads"):
        kv.check_integrity([request])


def test_admission_counts_a_window_and_a_chunk_not_the_whole_sequence() -> None:
    """The pool a request needs at once: prompt 10 + 1,000 tokens is 253 blocks of 4 without
    a window; with one of 8 keys and 16-token chunks, max(10, 12) = 12 tokens indexed (3
    blocks) and (8 + 16) / 4 + 2 = 8 moving: 11."""
    plain = AdmissionLimits(max_model_len=4096, vocab_size=100, num_blocks=11, block_size=BS)
    windowed = AdmissionLimits(max_model_len=4096, vocab_size=100, num_blocks=11, block_size=BS,
                               window=WINDOW, chunk_tokens=16)
    assert plain.blocks_held_at_most(10, 1000) == 253
    assert windowed.blocks_held_at_most(10, 1000) == 11
    assert windowed.blocks_held_at_most(10, 2) == 3  # the whole sequence is fewer
    windowed.check_fits_pool(10, 1000)
    with pytest.raises(ValueError, match="needs 253 KV blocks"):
        plain.check_fits_pool(10, 1000)
    assert windowed.default_max_tokens(10) == 4086 and plain.default_max_tokens(10) == 34
