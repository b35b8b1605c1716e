"""RadixCache against a naive reference model, plus focused unit tests.

The reference model stores the cache as a prefix-closed set of block-aligned token
prefixes (prefix -> block id of its last block) and a set of tails (a cached prefix
plus 1..block_size-1 tokens -> the block holding those), each with a logical access
time and a lock test by brute force. It shares no code with the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloom.cache.block_pool import BlockPool
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.radix_cache import RadixCache, RadixCacheError
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

Prefix = tuple[int, ...]
Key = tuple[str | None, Prefix]  # (cache salt, prefix)


class ReferenceCache:
    """The cache's contents as plain data: what the tree must be equivalent to. A cached
    prefix is keyed by its salt too (``Key``): the same tokens under two salts are two
    entries, and nothing relates them but the shared LRU clock and pool."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.blocks: dict[Key, int] = {}  # (salt, block-aligned prefix) -> block holding its last block
        self.tails: dict[Key, int] = {}  # (salt, prefix + a partly filled block's tokens) -> that block
        self.access: dict[Key, int] = {}
        self.clock = 0
        self.locks: list[Key] = []  # multiset of locked prefixes

    def _prefixes(self, tokens: list[int] | Prefix) -> list[Prefix]:
        return [tuple(tokens[: (i + 1) * self.bs]) for i in range(len(tokens) // self.bs)]

    def match(self, tokens: list[int], salt: str | None) -> tuple[Prefix, list[int]]:
        prefix: Prefix = ()
        blocks: list[int] = []
        for p in self._prefixes(tokens):
            if (salt, p) not in self.blocks:
                break
            prefix = p
            blocks.append(self.blocks[salt, p])
        return prefix, blocks

    def partial(self, tokens: list[int], prefix: Prefix, salt: str | None) -> tuple[int, set[int]]:
        """Past ``prefix`` (a match): the most leading tokens that a cached block after it
        shares with ``tokens``, and every block that shares that many (0 and none if no
        block shares a token)."""
        rest = tuple(tokens[len(prefix):])
        best, blocks = 0, set()
        after = [(key, block_id) for key, block_id in self.blocks.items() if len(key[1]) == len(prefix) + self.bs]
        after += [(key, block_id) for key, block_id in self.tails.items() if self._whole(key[1]) == len(prefix)]
        for (q_salt, q), block_id in after:
            if q_salt != salt or q[: len(prefix)] != prefix:
                continue
            count = next((i for i, (a, b) in enumerate(zip(q[len(prefix):], rest, strict=False)) if a != b),
                         min(len(q) - len(prefix), len(rest)))
            if count > best:
                best, blocks = count, set()
            if count == best and count:
                blocks.add(block_id)
        return best, blocks

    def _whole(self, tokens: Prefix) -> int:
        return len(tokens) // self.bs * self.bs

    def touch(self, prefix: Prefix, salt: str | None) -> None:
        if prefix:
            self.clock += 1
            for p in self._prefixes(prefix):
                self.access[salt, p] = self.clock
            if len(prefix) % self.bs:  # a tail
                self.access[salt, prefix] = self.clock

    def tails_under(self, salt: str | None, prefix: Prefix) -> list[Key]:
        return [(s, q) for s, q in self.tails
                if s == salt and self._whole(q) == len(prefix) and q[: len(prefix)] == prefix]

    def insert_tail(self, tokens: list[int], block_id: int, salt: str | None) -> bool:
        """Kept unless its whole blocks are not all cached or a cached block after them
        starts with its tokens; unlocked tails that are prefixes of it go."""
        whole = self._whole(tuple(tokens))
        prefix, rest = tuple(tokens[:whole]), tuple(tokens[whole:])
        if prefix and (salt, prefix) not in self.blocks:
            return False
        after = [q for s, q in self.blocks if s == salt and len(q) == whole + self.bs and q[:whole] == prefix]
        after += [q for _, q in self.tails_under(salt, prefix)]
        if any(q[whole : whole + len(rest)] == rest for q in after):
            return False
        for key in self.tails_under(salt, prefix):
            if not self.locked(key) and rest[: len(key[1]) - whole] == key[1][whole:]:
                del self.tails[key], self.access[key]
        self.tails[salt, tuple(tokens)] = block_id
        self.touch(tuple(tokens), salt)
        return True

    def insert(self, tokens: list[int], block_ids: list[int], salt: str | None) -> None:
        for p, block_id in zip(self._prefixes(tokens), block_ids, strict=False):
            self.blocks.setdefault((salt, p), block_id)
        self.touch(tuple(tokens), salt)

    def locked(self, key: Key) -> bool:
        salt, prefix = key
        if len(prefix) % self.bs:  # a tail is locked only as itself
            return key in self.locks
        return any(s == salt and q[: len(prefix)] == prefix for s, q in self.locks)

    def num_evictable(self) -> int:
        return sum(not self.locked(k) for k in [*self.blocks, *self.tails])

    def evict(self, count: int) -> int:
        """Drop the least recently used unlocked prefix that nothing extends, ``count`` times."""
        done = 0
        while done < count:
            leaves = [
                (salt, p) for salt, p in self.blocks
                if not self.locked((salt, p)) and not self.tails_under(salt, p) and not any(
                    s == salt and len(q) == len(p) + self.bs and q[: len(p)] == p for s, q in self.blocks)
            ] + [key for key in self.tails if not self.locked(key)]
            if not leaves:
                break
            oldest = min(leaves, key=lambda k: self.access[k])
            assert sum(self.access[k] == self.access[oldest] for k in leaves) == 1, "LRU tie"
            (self.tails if oldest in self.tails else self.blocks).pop(oldest)
            del self.access[oldest]
            done += 1
        return done


@dataclass
class SimRequest:
    """A request as the KVCacheManager keeps it: its own references and one locked handle."""

    block_ids: list[int]
    handle: object | None
    locked_prefix: Prefix
    salt: str | None = None
    tokens: tuple[int, ...] = ()  # all computed: its partly filled last block is offered as a tail


class Harness:
    """Runs the same operations on the RadixCache and the reference; checks after each."""

    def __init__(self, block_size: int, num_blocks: int = 10) -> None:
        self.bs = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size)
        self.ref = ReferenceCache(block_size)
        self.requests: list[SimRequest] = []
        self.pins: list[tuple[object, Prefix, str | None]] = []

    def match(self, tokens: list[int], salt: str | None = None) -> tuple[object | None, Prefix, list[int]]:
        got = self.cache.match(tokens, salt)
        prefix, blocks = self.ref.match(tokens, salt)
        self.ref.touch(prefix, salt)
        assert (got.num_tokens, got.block_ids) == (len(prefix), blocks)
        assert (got.handle is None) == (not prefix)
        num_partial, partial_blocks = self.ref.partial(tokens, prefix, salt)
        if num_partial:
            assert got.partial is not None and got.partial.num_tokens == num_partial, (got.partial, num_partial)
            assert got.partial.block_id in partial_blocks
            assert got.num_hit_tokens == len(prefix) + num_partial
        else:
            assert got.partial is None
        if got.partial is not None and got.partial.handle.is_tail:
            assert tuple(tokens[: len(prefix)]) + tuple(got.partial.handle.key) in \
                {q for _, q in self.ref.tails_under(salt, prefix)}
        # A reason for every miss and every hit shorter than the prompt's full blocks, or
        # with a partial block, than the prompt.
        if got.partial is None:
            assert (got.miss_reason is None) == (bool(prefix) and len(prefix) == len(tokens) // self.bs * self.bs)
        else:
            assert (got.miss_reason is None) == (got.num_hit_tokens == len(tokens))
        return got, prefix, blocks

    def evict(self, count: int) -> None:
        expected = min(max(count, 0), self.ref.num_evictable())
        assert self.cache.evict(count) == expected
        assert self.ref.evict(count) == expected

    def lock(self, handle: object | None, prefix: Prefix, salt: str | None = None) -> None:
        self.cache.lock(handle)
        if prefix:
            self.ref.locks.append((salt, prefix))

    def unlock(self, handle: object | None, prefix: Prefix, salt: str | None = None) -> None:
        self.cache.unlock(handle)
        if prefix:
            self.ref.locks.remove((salt, prefix))

    def run_request(self, tokens: list[int], use_match: bool, first_insert: int, salt: str | None = None) -> None:
        """Admit, compute and index a request the way the KVCacheManager does."""
        num_full = len(tokens) // self.bs
        got, prefix, blocks = self.match(tokens, salt) if use_match else (None, (), [])
        handle = got.handle if got is not None else None
        self.lock(handle, prefix, salt)
        needed = -(-len(tokens) // self.bs) - len(blocks)  # its last, partly filled block too
        shortfall = needed - self.pool.num_free_blocks
        if shortfall > 0:
            if shortfall > self.cache.num_evictable_blocks:
                self.unlock(handle, prefix, salt)
                return
            self.evict(shortfall)
        self.pool.incref(blocks)
        request = SimRequest(blocks + self.pool.allocate(needed), handle, prefix, salt, tuple(tokens))
        self.requests.append(request)
        # Index in two steps, as blocks fill: lock the new handle, then release the old.
        for num_blocks in sorted({min(first_insert, num_full), num_full}):
            done = tokens[: num_blocks * self.bs]
            new_handle = self.cache.insert(done, request.block_ids[:num_blocks], salt)
            self.ref.insert(done, request.block_ids[:num_blocks], salt)
            assert (new_handle is None) == (num_blocks == 0)
            self.lock(new_handle, tuple(done), salt)
            self.unlock(request.handle, request.locked_prefix, salt)
            request.handle, request.locked_prefix = new_handle, tuple(done)

    def finish_request(self, index: int) -> None:
        request = self.requests.pop(index % len(self.requests))
        tokens, num_full = list(request.tokens), len(request.tokens) // self.bs
        if len(tokens) % self.bs:  # offered while its path is locked, as the KV manager does
            took = self.cache.insert_tail(tokens, request.block_ids[num_full], request.salt)
            assert took == self.ref.insert_tail(tokens, request.block_ids[num_full], request.salt)
        self.unlock(request.handle, request.locked_prefix, request.salt)
        self.pool.decref(request.block_ids)

    def check(self) -> None:
        self.cache.check_integrity()
        holders: dict[int, int] = {}
        cached = [*self.ref.blocks.values(), *self.ref.tails.values()]
        for block_id in [*cached, *(b for r in self.requests for b in r.block_ids)]:
            holders[block_id] = holders.get(block_id, 0) + 1
        self.pool.check_integrity(holders)
        assert sorted(self.cache.held_blocks()) == sorted(cached)
        assert self.cache.num_cached_blocks == len(cached)
        assert self.cache.num_evictable_blocks == self.ref.num_evictable()


TOKENS = st.lists(st.integers(0, 2), max_size=12)  # a tiny alphabet: prefixes collide often
SALTS = st.sampled_from([None, None, "a", "b"])  # mostly unsalted; two tenants beside
# Weighted towards finishing and evicting: the interesting cases need idle cached blocks
# whose LRU order was changed by later hits, under a small pool's pressure.
OPS = st.one_of(
    st.tuples(st.just("request"), TOKENS, st.booleans(), st.integers(0, 4), SALTS),
    st.tuples(st.just("finish"), st.integers(0, 100)),
    st.tuples(st.just("finish"), st.integers(0, 100)),
    st.tuples(st.just("match"), TOKENS, st.booleans(), SALTS),
    st.tuples(st.just("unpin"), st.integers(0, 100)),
    st.tuples(st.just("evict"), st.integers(-1, 4)),
    st.tuples(st.just("evict"), st.integers(1, 12)),
    st.tuples(st.just("peek"), TOKENS, SALTS),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), ops=st.lists(OPS, min_size=10, max_size=50))
def test_matches_reference_model(block_size: int, ops: list[tuple]) -> None:
    h = Harness(block_size)
    for op in ops:
        kind = op[0]
        if kind == "request":
            h.run_request(op[1], use_match=op[2], first_insert=op[3], salt=op[4])
        elif kind == "finish" and h.requests:
            h.finish_request(op[1])
        elif kind == "match":
            got, prefix, _ = h.match(op[1], op[3])
            if op[2] and got.handle is not None:  # pin it, as an admitted request would
                h.lock(got.handle, prefix, op[3])
                h.pins.append((got.handle, prefix, op[3]))
            tail = got.partial.handle if got.partial is not None else None
            if op[2] and tail is not None and tail.is_tail:  # and its copy's source
                key = prefix + tuple(tail.key)
                h.lock(tail, key, op[3])
                h.pins.append((tail, key, op[3]))
        elif kind == "unpin" and h.pins:
            h.unlock(*h.pins.pop(op[1] % len(h.pins)))
        elif kind == "evict":
            h.evict(op[1])
        elif kind == "peek":
            prefix = h.ref.match(op[1], op[2])[0]
            assert h.cache.cached_prefix_length(op[1], op[2]) == len(prefix) + h.ref.partial(op[1], prefix, op[2])[0]
        h.check()
    # Releasing everything leaves only the cache's references; evicting all empties the pool.
    while h.requests:
        h.finish_request(0)
    while h.pins:
        h.unlock(*h.pins.pop())
    h.check()
    h.evict(h.pool.num_blocks)
    h.check()
    assert h.pool.num_free_blocks == h.pool.num_blocks and h.cache.num_cached_blocks == 0


# ---- unit tests ---------------------------------------------------------------------------
def make(block_size: int = 2, num_blocks: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, block_size)


def index(pool: BlockPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` as a finished request would: afterwards only the cache holds them."""
    blocks = pool.allocate(len(tokens) // cache.block_size)
    cache.insert(tokens, blocks)
    pool.decref(blocks)
    return blocks


def test_partial_match_splits_at_block_boundary() -> None:
    pool, cache = make()
    a, b, c = index(pool, cache, [1, 2, 3, 4, 5, 6])
    hit = cache.match([1, 2, 3, 4, 9, 9])
    assert (hit.num_tokens, hit.block_ids) == (4, [a, b])
    assert "block 2 diverges" in (hit.miss_reason or "")
    (upper,) = cache.root.children.values()
    assert upper is hit.handle and upper.key == [1, 2, 3, 4] and upper.block_ids == [a, b]
    assert [n.key for n in upper.children.values()] == [[5, 6]]
    cache.lock(hit.handle)  # pins exactly the matched blocks
    assert cache.num_evictable_blocks == 1
    assert cache.evict(3) == 1 and pool.ref_count(c) == 0 and pool.ref_count(a) == 1
    cache.check_integrity()


def test_match_stops_at_last_full_block() -> None:
    pool, cache = make()
    a, b = index(pool, cache, [1, 2, 3, 4])
    assert (cache.match([1, 2, 3]).num_tokens, cache.match([1, 2, 3]).miss_reason) == (2, None)
    diverged = cache.match([1, 2, 3, 9])  # differs in the second half of block 1
    assert diverged.num_tokens == 2 and diverged.block_ids == [a]
    longer = cache.match([1, 2, 3, 4, 5, 6])
    assert longer.num_tokens == 4 and "no cached continuation" in (longer.miss_reason or "")
    assert cache.cached_prefix_length([1, 2, 3, 4, 7]) == 4
    cache.check_integrity()


def test_miss_reasons_and_hit_statistics() -> None:
    pool, cache = make(block_size=4)
    assert "shorter than one block" in (cache.match([1, 2, 3]).miss_reason or "")
    assert cache.match([1, 2, 3, 4]).miss_reason == "no cached prefix"
    index(pool, cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4, 5]).miss_reason is None  # all full blocks hit
    assert cache.match([]).handle is None
    assert (cache.num_match_queries, cache.num_queried_tokens, cache.num_matched_tokens) == (4, 12, 4)
    assert cache.hit_rate == pytest.approx(4 / 12)


def test_insert_keeps_existing_blocks_and_indexes_only_the_new_suffix() -> None:
    pool, cache = make()
    first = pool.allocate(2)  # request 1 computed [1 2 | 3 4]
    second = pool.allocate(3)  # request 2 computed the same prefix itself, plus [5 6]
    h1 = cache.insert([1, 2, 3, 4], first)
    assert cache.insert([1, 2, 3, 4], second[:2]) is h1  # same node; duplicates not indexed
    assert [pool.ref_count(b) for b in first + second] == [2, 2, 1, 1, 1]
    h2 = cache.insert([1, 2, 3, 4, 5, 6], second)
    assert sorted(cache.held_blocks()) == sorted([*first, second[2]])
    assert pool.ref_count(second[2]) == 2 and cache.match([1, 2, 3, 4, 5, 6]).block_ids == [*first, second[2]]
    cache.lock(h2)
    pool.decref(first + second)  # both requests finish; the duplicates return to the pool
    assert pool.num_free_blocks == 16 - 3
    cache.unlock(h2)
    cache.check_integrity()
    pool.check_integrity({b: 1 for b in cache.held_blocks()})


def test_split_keeps_handles_valid() -> None:
    pool, cache = make()
    blocks = pool.allocate(3)
    handle = cache.insert([1, 2, 3, 4, 5, 6], blocks)
    cache.lock(handle)
    cache.match([1, 2, 7, 7])  # splits the locked edge above the handle
    cache.insert([1, 2, 3, 4, 8, 8], [*blocks[:2], *pool.allocate(1)])  # and again
    cache.check_integrity()
    assert cache.num_evictable_blocks == 1  # only the new [8 8] leaf
    cache.unlock(handle)
    assert cache.num_evictable_blocks == 4
    with pytest.raises(RadixCacheError):
        cache.unlock(handle)


def test_eviction_is_least_recently_used_first() -> None:
    pool, cache = make(block_size=1)
    x = index(pool, cache, [1, 1])
    y = index(pool, cache, [2, 2])
    z = index(pool, cache, [3, 3])
    cache.match([1, 1])  # x becomes the most recently used
    assert cache.evict(1) == 1 and cache.held_blocks().count(y[1]) == 0  # y's tail first
    assert cache.evict(2) == 2 and set(cache.held_blocks()) == {*x, z[0]}
    assert cache.evict(10) == 3 and cache.num_cached_blocks == 0 and cache.num_evicted_blocks == 6
    assert pool.num_free_blocks == 16


def test_eviction_frees_children_before_parents_and_respects_locks() -> None:
    pool, cache = make()
    index(pool, cache, [1, 2, 3, 4])
    index(pool, cache, [1, 2, 5, 6])
    locked = cache.match([1, 2, 3, 4])
    cache.lock(locked.handle)
    assert cache.num_evictable_blocks == 1
    assert cache.evict(0) == 0 and cache.evict(5) == 1  # only the [5 6] leaf was free
    assert cache.match([1, 2, 3, 4]).block_ids == locked.block_ids
    cache.unlock(locked.handle)
    assert cache.evict(5) == 2 and cache.num_cached_blocks == 0
    with pytest.raises(RadixCacheError):
        cache.lock(locked.handle)  # evicted: the handle is stale
    cache.check_integrity()


def test_contract_violations_raise() -> None:
    pool, cache = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], pool.allocate(2))
    blocks = pool.allocate(1)
    cache.insert([1, 2], blocks)
    with pytest.raises(RadixCacheError):
        cache.insert([7, 7], blocks)  # one block cannot hold two different token runs
    with pytest.raises(TypeError):
        cache.lock("not a handle")
    cache.lock(None)
    cache.unlock(None)


def test_kv_manager_shares_prefix_and_evicts_under_pressure() -> None:
    params = SamplingParams()
    pool = BlockPool(6)
    kv = KVCacheManager(pool, block_size=2, prefix_cache=RadixCache(pool, 2))

    def admit(prompt: list[int]) -> Request:
        request = Request(str(prompt), prompt, params)
        prefix = kv.match_prefix(request)
        assert kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix)
        request.num_computed_tokens = request.num_tokens
        kv.cache_computed_blocks(request)
        return request

    first = admit([1, 2, 3, 4, 5])
    second = admit([1, 2, 3, 4, 6])
    assert second.block_ids[:2] == first.block_ids[:2]  # the 4-token prefix is shared
    kv.check_integrity([first, second])
    kv.free(first)
    kv.free(second)
    kv.check_integrity([])
    third = admit([7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7])  # needs all 6 blocks: evicts the rest
    assert kv.num_evicted_blocks == 4  # the two shared blocks and the tails [5] and [6]
    kv.check_integrity([third])


# ---- hits that end inside a block -----------------------------------------------------------
def test_partial_block_inside_an_edge_is_the_next_block_of_that_edge() -> None:
    pool, cache = make(block_size=4)
    a, b, c = index(pool, cache, list(range(1, 13)))
    hit = cache.match([1, 2, 3, 4, 5, 6, 77, 78, 79])
    assert (hit.num_tokens, hit.block_ids) == (4, [a])
    assert hit.partial is not None and (hit.partial.block_id, hit.partial.num_tokens) == (b, 2)
    assert hit.num_hit_tokens == 6
    assert hit.partial.handle.block_ids == [b, c]  # the lower half of the split: the block is its first
    assert hit.miss_reason == ("prefix hit of 6 tokens, 2 of them copied from a cached block: token 6 "
                               "differs from every cached continuation")
    assert cache.num_matched_tokens == 6
    cache.check_integrity()


def test_partial_block_is_the_child_that_agrees_longest_and_may_be_the_prompts_end() -> None:
    pool, cache = make(block_size=4)
    index(pool, cache, [1, 2, 3, 4, 5, 9, 9, 9])
    _, best = index(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    index(pool, cache, [1, 2, 3, 4, 5, 6, 0, 0])
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 1, 2], [1, 2, 3, 4, 5, 6, 7]):  # the second ends inside the block
        hit = cache.match(tokens)
        assert hit.num_tokens == 4 and hit.partial is not None
        assert (hit.partial.block_id, hit.partial.num_tokens) == (best, 3)
        assert cache.cached_prefix_length(tokens) == 7
    assert cache.match([1, 2, 3, 4, 8, 8]).partial is None  # no child starts with token 8
    first_block_only = cache.match([1, 2, 3, 7])  # a partial hit of the very first block
    assert first_block_only.handle is None and first_block_only.num_hit_tokens == 3
    cache.check_integrity()


def test_kv_manager_copies_the_partial_block_and_pins_it_until_the_step_runs() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, 4)
    kv = KVCacheManager(pool, 4, cache)
    _, _, source = index(pool, cache, list(range(1, 13)))
    params = SamplingParams(max_tokens=4)
    request = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 77, 78, 79], params)
    hit = kv.match_prefix(request)
    assert (hit.num_tokens, hit.num_hit_tokens) == (8, 10)
    assert kv.allocate_slots(request, request.num_tokens - hit.num_hit_tokens, hit)
    assert len(request.block_ids) == 4  # two shared, the copy's destination, one more
    copy = kv.block_copy(request)
    assert copy is not None and (copy.src, copy.dst) == (source, request.block_ids[2])
    request.num_computed_tokens = hit.num_hit_tokens
    # Until the step runs, the source cannot be evicted even though no request shares it.
    assert cache.evict(8) == 0 and pool.ref_count(source) == 1
    kv.check_integrity([request])
    request.num_computed_tokens = request.num_tokens  # the step ran
    kv.cache_computed_blocks(request)
    assert kv.block_copy(request) is None
    kv.free(request)
    kv.check_integrity([])
    # Cached: the 3 blocks indexed first, the request's own third block and its tail [79].
    assert cache.evict(8) == 5 and pool.num_free_blocks == 8  # the source went with the rest


def test_kv_manager_releases_the_copy_source_of_a_request_freed_before_its_step() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, 4)
    kv = KVCacheManager(pool, 4, cache)
    index(pool, cache, list(range(1, 9)))
    request = Request("b", [1, 2, 3, 5, 6], SamplingParams(max_tokens=4))
    hit = kv.match_prefix(request)
    assert (hit.num_tokens, hit.num_hit_tokens, hit.handle) == (0, 3, None)
    assert kv.allocate_slots(request, 2, hit) and kv.block_copy(request) is not None
    request.num_computed_tokens = hit.num_hit_tokens  # as admission counts them
    kv.free(request)  # aborted before its first step: its block never got the copy
    kv.check_integrity([])
    assert cache.num_evictable_blocks == 2 and cache.num_inserted_tails == 0


# ---- tails: a freed request's partly filled last block ---------------------------------------
def test_a_freed_requests_last_tokens_serve_the_next_turn_as_a_copied_tail() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, 4)
    kv = KVCacheManager(pool, 4, cache)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(first, 5, kv.match_prefix(first))
    first.append_output_token(6)  # computed [1..5] and sampled 6; 6's KV is not computed
    first.num_computed_tokens = 5
    own = first.block_ids[1]
    kv.free(first)
    kv.check_integrity([])
    (node,) = cache.root.children.values()
    assert list(node.tails) == [(5,)] and node.tails[5,].block_ids == [own] and pool.ref_count(own) == 1
    # The next turn: the whole history and a new message.
    second = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    hit = kv.match_prefix(second)
    assert (hit.num_tokens, hit.num_hit_tokens) == (4, 5) and hit.partial is not None
    assert (hit.partial.block_id, hit.partial.handle) == (own, node.tails[5,])
    assert kv.allocate_slots(second, second.num_tokens - hit.num_hit_tokens, hit)
    assert kv.block_copy(second).src == own
    assert cache.evict(8) == 0  # the tail is locked until the copying step is launched
    second.num_computed_tokens = second.num_tokens
    kv.cache_computed_blocks(second)
    kv.free(second)
    kv.check_integrity([])
    # The full [5 6 7 8] block now serves what the tail did: a new tail [5] would be
    # declined; the old one stays until evicted, before the node it hangs from.
    declined = pool.allocate(1)
    assert cache.insert_tail([1, 2, 3, 4, 5], declined[0]) is False
    pool.decref(declined)
    assert cache.num_cached_blocks == 4  # [1..4], [5..8], the tails [5] and [9]
    assert cache.evict(2) == 2 and list(node.tails) == [] and cache.num_cached_blocks == 2
    kv.check_integrity([])


def test_a_tail_is_kept_only_where_nothing_serves_it_and_replaces_those_it_serves() -> None:
    pool, cache = make(block_size=4)
    index(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    short, longer, again, other, served, orphan = pool.allocate(6)
    assert cache.insert_tail([1, 2, 3, 4, 9], short)
    (top,) = cache.root.children.values()  # [1..4], split off for the tail to hang from
    assert top.key == [1, 2, 3, 4] and list(top.tails) == [(9,)]
    assert cache.insert_tail([1, 2, 3, 4, 9, 9], longer)  # serves all that [9] did
    assert list(top.tails) == [(9, 9)] and pool.ref_count(short) == 1  # only the caller's reference left
    assert not cache.insert_tail([1, 2, 3, 4, 9], again)  # a prefix of a kept tail
    assert not cache.insert_tail([1, 2, 3, 4, 5, 6], served)  # the cached block [5 6 7 8] starts so
    assert not cache.insert_tail([1, 2, 3, 9, 9], orphan)  # its whole block is not cached
    hit = cache.match([1, 2, 3, 4, 9, 9, 9, 3])
    assert hit.partial is not None and (hit.partial.block_id, hit.partial.num_tokens) == (longer, 2)
    cache.lock(hit.partial.handle)  # a copy's source is never dropped for a longer tail
    assert cache.insert_tail([1, 2, 3, 4, 9, 9, 9], other)
    assert set(top.tails) == {(9, 9), (9, 9, 9)}
    with pytest.raises(RadixCacheError):
        cache.insert_tail([1, 2, 3, 4, 6], other)  # one block cannot be two tails
    with pytest.raises(ValueError):
        cache.insert_tail([1, 2, 3, 4], other)  # a whole block is not a tail
    cache.check_integrity()
    assert cache.num_evictable_blocks == 2  # [5..8] and the tail [9 9 9]; the lock pins [1..4] too
    cache.unlock(hit.partial.handle)
    pool.decref([short, longer, again, other, served, orphan])
    assert cache.evict(16) == 4 and pool.num_free_blocks == 16
    cache.check_integrity()


def test_tails_under_a_root_start_a_salts_tree_and_go_with_it() -> None:
    pool, cache = make(block_size=4)
    block = pool.allocate(1)[0]
    assert cache.insert_tail([1, 2], block, salt="tenant")
    assert cache.match([1, 2, 3]).partial is None  # the unsalted tree has nothing
    hit = cache.match([1, 2, 3], salt="tenant")
    assert hit.partial is not None and (hit.partial.block_id, hit.num_hit_tokens) == (block, 2)
    cache.check_integrity()
    pool.decref([block])
    assert cache.evict(1) == 1 and pool.num_free_blocks == 16
    cache.check_integrity()  # the emptied salt's root went


def test_a_cache_that_keeps_states_declines_tails() -> None:
    pool = BlockPool(4)
    cache = RadixCache(pool, 2, state_slots=range(2))
    assert not cache.insert_tail([1, 2, 3], pool.allocate(1)[0])
    assert cache.num_cached_blocks == 0


def test_a_salted_tail_that_replaces_the_salts_only_tail_stays_in_the_tree() -> None:
    """Found by the model test: under a salt whose tree holds one tail alone, a longer
    tail that extends it replaced it and emptied the salt's root, which the cache then let
    go with the new tail under it (indexed, but in no tree)."""
    harness = Harness(block_size=4)
    for op in [("request", [0], False, 0, "a"), ("finish", 0), ("request", [0, 0], False, 0, "a"), ("finish", 0)]:
        if op[0] == "request":
            harness.run_request(op[1], op[2], op[3], op[4])
        else:
            harness.finish_request(op[1])
        harness.check()
    got = harness.cache.match([0, 0, 1], "a")
    assert got.partial is not None and got.partial.num_tokens == 2  # the longer tail serves
