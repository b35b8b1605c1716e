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


def test_blocks_indexed_past_the_prompt_are_given_back_when_the_first_block_dies() -> None:
    """A 6-token prompt indexes block 0; block 1 (keys 4 .. 7), filled by decoding, is
    indexed at position 7. At position 11 block 0 dies: the request stops indexing and
    gives block 1 back to itself (it dies with the window, and no one else uses it), so
    the cache keeps the prompt's block alone, unpinned at once (the window has passed it)."""
    kv = manager()
    request = prefill(kv, [1, 2, 3, 4, 5, 6])
    for _ in range(5):  # positions 6 .. 10
        decode(kv, request, [request])
    assert kv.prefix_cache.num_cached_blocks == 2 and kv.prefix_cache.num_evictable_blocks == 0
    decode(kv, request, [request])  # position 11
    assert kv.prefix_cache.num_cached_blocks == 1 and kv.prefix_cache.num_evictable_blocks == 1
    assert kv.prefix_cache.match([1, 2, 3, 4, 5, 6, 7, 7, 7]).num_tokens == 4
    assert kv.num_held_blocks(request) == 2 and kv.pool.num_free_blocks == 16 - 1 - 2  # cached + held
    kv.free(request)
    kv.check_integrity([])
    assert kv.pool.num_free_blocks == 15


def test_blocks_another_request_uses_stay_indexed() -> None:
    """The same, with a second request that hit blocks 0 and 1 and holds them: the first
    request's path stays whole (pinned by the second's lock) when its first block dies."""
    kv = manager()
    first = prefill(kv, [1, 2, 3, 4, 5, 6])
    for _ in range(5):
        decode(kv, first, [first])
    second = prefill(kv, [1, 2, 3, 4, 5, 6, 7, 7, 9])  # hits the 8 indexed tokens
    assert second.block_ids[:2] == first.block_ids[:2]
    decode(kv, first, [first, second])  # position 11: block 0 dies for the first request
    assert kv.prefix_cache.num_cached_blocks == 2 and kv.prefix_cache.num_evictable_blocks == 0
    for _ in range(4):
        decode(kv, first, [first, second])
    kv.free(second)
    kv.check_integrity([first])
    # Blocks 0 and 1 and the second's tail (its 9th token): the first unlocked its path once its window passed it.
    assert kv.prefix_cache.num_cached_blocks == kv.prefix_cache.num_evictable_blocks == 3
    kv.free(first)
    kv.check_integrity([])


def test_unindex_after_trims_forgets_and_stops_where_others_use_the_path() -> None:
    """The radix tree's part, on hand-built paths: a node straddling the kept length is
    trimmed to it, nodes past it are forgotten, and a node another lock pins, or that has
    another child, stays (with every node above it)."""
    pool = BlockPool(16)
    cache = RadixCache(pool, BS)
    blocks = pool.allocate(3)
    handle = cache.insert(list(range(12)), blocks)  # one node of three blocks
    cache.lock(handle)
    kept, length = cache.unindex_after(handle, 4)  # trims to its first block
    assert (kept is handle, length, handle.block_ids) == (True, 4, blocks[:1])
    assert [pool.ref_count(b) for b in blocks] == [2, 1, 1]  # the caller's own references stay
    assert cache.num_evictable_blocks == 0  # the kept block is locked by the caller
    cache.unlock(kept)
    assert cache.unindex_after(None, 0) == (None, 0)
    cache.lock(kept)
    assert cache.unindex_after(kept, 0) == (None, 0) and cache.num_cached_blocks == 0
    cache.check_integrity()

    pool = BlockPool(16)
    cache = RadixCache(pool, BS)
    ours = pool.allocate(3)
    deep = cache.insert(list(range(12)), ours)
    cache.lock(deep)
    other = cache.insert(list(range(8)) + [50, 51, 52, 53], ours[:2] + pool.allocate(1))  # a sibling below 8
    middle = other.parent
    assert middle is deep.parent and middle.num_blocks == 2
    kept, length = cache.unindex_after(deep, 0)  # forgets our leaf; the node above has another child
    assert (kept, length) == (middle, 8) and cache.num_cached_blocks == 3
    cache.lock(other)
    cache.unlock(kept)
    kept, length = cache.unindex_after(other, 4)  # the other's leaf goes; middle straddles 4: trimmed
    assert length == 4 and kept is middle and middle.num_blocks == 1
    cache.check_integrity()


def test_a_request_past_its_window_still_leaves_its_tail_where_its_prompt_is_cached() -> None:
    """A 13-token prompt (blocks 0-2 indexed) and one decode step, which lets block 0 go:
    at its end the request's last block (tokens 12 and 13) is offered as a tail and kept,
    as the whole blocks before it are cached (a beam search's next round, or the next turn,
    copies those tokens); a request past its prompt's cached blocks has its tail declined."""
    kv = manager()
    prompt = list(range(1, 14))
    request = prefill(kv, prompt)
    decode(kv, request, [request])  # position 13: (13 - 7) // 4 = 1 block dead
    assert request.block_ids[0] == NO_BLOCK
    kv.free(request)
    kv.check_integrity([])
    assert kv.prefix_cache.num_inserted_tails == 1
    hit = kv.match_prefix(Request("next", prompt + [7, 5], SamplingParams()))
    assert hit.num_tokens == 12 and hit.partial is not None and hit.partial.num_tokens == 2

    longer = prefill(kv, list(range(100, 106)))  # 6 tokens: block 0 indexed
    for _ in range(8):  # positions 6 .. 13: blocks 1-2 never indexed (the window passed block 0 at 11)
        decode(kv, longer, [longer])
    kv.free(longer)
    kv.check_integrity([])
    assert kv.prefix_cache.num_inserted_tails == 1  # its tail (tokens 12, 13) hangs from nothing cached
