"""KVCacheManager: gives requests KV slots, shares cached prefixes, frees on finish.

Ownership: this manager is the one writer of ``request.block_ids`` (the scheduler
owns the rest of a request's state). A request holds one pool reference per entry
of its ``block_ids``; the prefix cache holds one per block it indexes. A request's blocks beyond its
cached prefix are private to it, so a request never writes into a shared block.

A hit may end inside a block (``PrefixMatch.partial``): the request's first private
block then starts as a copy of the cached block that holds those tokens
(``block_copy``; the runner copies before the step's forward), and the cached block
stays locked until that step has been launched, so nothing evicts and reuses it first.

For a state-space model the prefix cache also keeps state checkpoints (a hit needs
one, cache/radix_cache.py), and this manager plans where a request saves them: where
its prompt leaves the cached tree (the next request with that prefix then hits it)
and at its prompt's last block boundary (a repeat, or the next turn of a chat,
hits it). The scheduler ends a chunk at each planned position
(``tokens_to_checkpoint``), has the runner copy the request's state into a reserved
slot after that step (``reserve_checkpoint``), and ``cache_computed_blocks``
attaches it to the node that ends there.

Sliding windows (``window`` > 0: every layer attends to at most its last ``window``
keys, Mistral's and Phi-3's layers): a key before ``num_computed_tokens + 1 - window``
is read by no query the request will ever compute, so a block wholly before that point
is dead to it. Once the prompt is computed, the request lets go of its dead blocks as
its window moves on (``_leave_window``): their entries in ``block_ids`` become
``NO_BLOCK`` (positions keep their indices; the batch sends block 0 there, which the
kernels, reading from the window's first key on, never touch; it holds finite values
whoever owns it, as the pool starts zeroed, so even a masked read would be harmless).
Its held KV is then its window, not its whole sequence. The prefix cache's view: the
prompt's blocks, and any filled before the first block died, are indexed as usual (hits
on a long shared prompt, or on an earlier turn that stayed within the window, are
unchanged). When the
first block dies the request stops indexing (the cache would keep the dead blocks
alive: a locked path pins every block above its end), gives back the blocks it indexed
past its prompt that no one else uses (``unindex_after``), and unlocks its path once
its window has passed the path's end, so the cached prompt becomes evictable like any
other. Not for a model with a layer without a window (Gemma 2 and 3, Qwen2's
max_window_layers): that layer reads every block, so none is ever dead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.batch import BlockCopy
from kvloom.cache.block_pool import BlockPool, BlockPoolError
from kvloom.cache.in_flight import NoPrefixesInFlight, PrefixesInFlight
from kvloom.cache.prefix_cache import PrefixCache, PrefixMatch
from kvloom.cache.windows import blocks_held_at_most, cdiv, num_dead_blocks
from kvloom.kv_spec import KVExport
from kvloom.request import NO_BLOCK, Request


@dataclass(slots=True)
class _CacheState:
    """Per-request link into the prefix cache."""

    handle: object | None = None  # locked node
    num_inserted_blocks: int = 0
    checkpoints: list[int] = field(default_factory=list)  # planned state checkpoint positions, ascending
    saving: tuple[int, int] | None = None  # (position, reserved slot): a state saved this step
    # A partial hit's copy into the first private block, and the lock on its source,
    # until the step that copies it has been launched (``cache_computed_blocks``).
    copy: BlockCopy | None = None
    copy_handle: object | None = None
    copy_end: int = 0  # tokens computed once the copy is in (the whole hit)
    # Under a sliding window: the leading entries of ``block_ids`` let go (NO_BLOCK), and
    # whether the request has stopped indexing blocks (it has once any is let go).
    num_dropped: int = 0
    windowed: bool = False


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, prefix_cache: PrefixCache, window: int = 0) -> None:
        """``prefix_cache`` must take its references in the same ``pool``. ``window``: the
        keys back from a query that any layer reads (every layer's sliding window, the
        largest), 0 where some layer reads the whole context."""
        if window < 0:
            raise ValueError(f"window must be 0 (none) or a number of keys, got {window}")
        self.block_size = block_size
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.window = window
        self._cache_state: dict[Request, _CacheState] = {}
        self.num_evicted_blocks = 0
        self.num_window_freed_blocks = 0  # blocks requests let go as their windows passed them

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-idle blocks count as free)."""
        reclaimable = self.prefix_cache.num_evictable_blocks
        return (self.pool.num_used_blocks - reclaimable) / self.pool.num_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks that eviction could reclaim."""
        return self.pool.num_free_blocks + self.prefix_cache.num_evictable_blocks

    def num_held_blocks(self, request: Request) -> int:
        """The blocks ``request`` holds references on (its window's, under a window)."""
        state = self._cache_state.get(request)
        return len(request.block_ids) - (state.num_dropped if state is not None else 0)

    def blocks_to_finish(self, request: Request) -> int:
        """The most blocks ``request`` will hold at once from admission to its last token
        (a decode step's chunk; longer prompt chunks are the admission check's)."""
        return blocks_held_at_most(self.block_size, self.window, request.num_prompt_tokens, request.max_tokens, 1)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def prefixes_in_flight(self, running: list[Request]) -> NoPrefixesInFlight:
        """Prompt blocks being computed by ``running`` requests (see ``in_flight``). None
        for a cache that keeps states: the running request saves no checkpoint where the
        waiting one would branch off, so waiting for its blocks would gain no hit."""
        if not self.prefix_cache.shares_prefixes or self.prefix_cache.keeps_states:
            return NoPrefixesInFlight()
        return PrefixesInFlight(self.block_size, running)

    def match_prefix(self, request: Request, max_tokens: int | None = None) -> PrefixMatch:
        """Look up the request's cached prefix, of at most ``max_tokens``; the last token
        is always left to compute because its logits are needed."""
        limit = request.num_tokens - 1 if max_tokens is None else min(max_tokens, request.num_tokens - 1)
        return self.prefix_cache.match(request.all_token_ids[:limit], request.cache_key)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: PrefixMatch | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; all or nothing.

        ``prefix`` (only for a request that holds no blocks yet) is attached first:
        its blocks are shared, its partial block is to be copied (``block_copy``); the
        scheduler then counts its ``num_hit_tokens`` as computed.
        """
        state = self._cache_state.get(request)
        if prefix is not None and (prefix.block_ids or prefix.partial is not None):
            if request.block_ids:
                raise BlockPoolError(f"request {request.request_id} already holds blocks")
            partial = prefix.partial
            copy_handle = partial.handle if partial is not None else None
            # Lock before evicting so that making room never evicts the hit itself.
            self.prefix_cache.lock(prefix.handle)
            self.prefix_cache.lock(copy_handle)
            total = cdiv(prefix.num_hit_tokens + num_new_tokens, self.block_size)
            needed = total - len(prefix.block_ids)
            if not self._reserve(needed):
                self.prefix_cache.unlock(copy_handle)
                self.prefix_cache.unlock(prefix.handle)
                return False
            self.pool.incref(prefix.block_ids)
            request.block_ids = list(prefix.block_ids) + self.pool.allocate(needed)
            state = self._cache_state[request] = _CacheState(prefix.handle, len(prefix.block_ids))
            if partial is not None:  # ``needed`` >= 1: the hit ends inside a private block
                state.copy = BlockCopy(partial.block_id, request.block_ids[len(prefix.block_ids)])
                state.copy_handle, state.copy_end = copy_handle, prefix.num_hit_tokens
            return True
        if state is not None and self.window:
            self._leave_window(request, state)
        needed = self.blocks_needed(request, num_new_tokens)
        if not self._reserve(needed):
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        if state is None:
            self._cache_state[request] = _CacheState()
        return True

    def _leave_window(self, request: Request, state: _CacheState) -> None:
        """Let go of the blocks no query from the request's next token on reads, once its
        prompt is computed (see the module's docstring). A request whose prompt KV is to
        be staged for another instance (``KVExport``) keeps its blocks.

        Under overlap scheduling the step still running may read a block let go here (its
        first queries are before ``num_computed_tokens``): whoever is given the block next
        writes it in a later step, which runs after that one (one stream or thread), and
        nothing else writes blocks while steps overlap (disaggregation's transfers refuse it)."""
        num_computed = request.num_computed_tokens
        if num_computed < request.num_prompt_tokens or isinstance(request.kv_transfer, KVExport):
            return
        num_dead = num_dead_blocks(num_computed, self.window, self.block_size)
        if num_dead <= state.num_dropped or state.copy is not None:
            return  # (a partial hit's copy is done once its first step is launched: a step later)
        if not state.windowed:
            # Indexes nothing from here on, and gives back what it indexed past its prompt
            # where no one else uses it: those blocks die with the window, and a path pinned
            # down to them would hold them until then (its prompt stays cached).
            state.windowed = True
            if state.num_inserted_blocks * self.block_size > request.num_prompt_tokens:
                prompt_blocks = request.num_prompt_tokens // self.block_size
                state.handle, kept = self.prefix_cache.unindex_after(state.handle, prompt_blocks * self.block_size)
                state.num_inserted_blocks = kept // self.block_size
        dead = request.block_ids[state.num_dropped:num_dead]
        self.pool.decref(dead)
        request.block_ids[state.num_dropped:num_dead] = [NO_BLOCK] * len(dead)
        state.num_dropped = num_dead
        self.num_window_freed_blocks += len(dead)
        if state.handle is not None and num_dead >= state.num_inserted_blocks:
            # The window has passed the indexed path's end: nothing this request reads is
            # on it, so it need not stay pinned (its blocks stay cached while the cache keeps them).
            self.prefix_cache.unlock(state.handle)
            state.handle = None

    def block_copy(self, request: Request) -> BlockCopy | None:
        """The copy a partial hit needs before the request's first step (None if none)."""
        state = self._cache_state.get(request)
        return state.copy if state is not None else None

    def plan_checkpoints(self, request: Request, prefix: PrefixMatch) -> None:
        """At admission (after ``allocate_slots``): where the request will save its state
        for later requests, if the cache keeps states; positions past its hit only."""
        state = self._cache_state.get(request)
        if state is None or not self.prefix_cache.keeps_states:
            return
        last = (request.num_tokens - 1) // self.block_size * self.block_size
        wanted = {last, prefix.branch_tokens}
        state.checkpoints = sorted(p for p in wanted if prefix.num_tokens < p <= last)

    def tokens_to_checkpoint(self, request: Request, num_new_tokens: int) -> int:
        """``num_new_tokens``, cut so that the chunk ends at the next planned checkpoint."""
        state = self._cache_state.get(request)
        if state is None or not state.checkpoints:
            return num_new_tokens
        return min(num_new_tokens, state.checkpoints[0] - request.num_computed_tokens)

    def reserve_checkpoint(self, request: Request, end: int) -> int | None:
        """For a chunk scheduled to end at ``end``: the slot its state is to be copied
        into after the step, if ``end`` is a planned checkpoint and a slot is to be had
        (a checkpoint is worth an eviction, never a wait: without a slot it is skipped)."""
        state = self._cache_state.get(request)
        if state is None or not state.checkpoints or state.checkpoints[0] != end:
            return None
        del state.checkpoints[0]
        slot = self.prefix_cache.reserve_state_slot()
        if slot is not None:
            state.saving = (end, slot)
        return slot

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no request holds (vLLM's ``reset_prefix_cache``).
        Returns whether the cache is empty now: False while requests hold cached blocks
        (theirs stay, and every later request may still hit them)."""
        self.num_evicted_blocks += self.prefix_cache.evict(self.prefix_cache.num_evictable_blocks)
        return self.prefix_cache.num_cached_blocks == 0

    def _reserve(self, needed: int) -> bool:
        """Ensure ``needed`` free blocks exist, evicting idle cached blocks if that suffices."""
        shortfall = needed - self.pool.num_free_blocks
        if shortfall > 0:
            if shortfall > self.prefix_cache.num_evictable_blocks:
                return False
            self.num_evicted_blocks += self.prefix_cache.evict(shortfall)
        return needed <= self.pool.num_free_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's newly full, computed blocks so later requests can share them."""
        state = self._cache_state.get(request)
        if state is None:
            return
        if state.copy is not None and request.num_computed_tokens > state.copy_end:
            self._copied(state)  # the step that copies was launched: the source is free to go
        if state.windowed:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full > state.num_inserted_blocks:
            handle = self.prefix_cache.insert(
                request.all_token_ids[: num_full * self.block_size], request.block_ids[:num_full], request.cache_key
            )
            self.prefix_cache.lock(handle)
            self.prefix_cache.unlock(state.handle)
            state.handle = handle
            state.num_inserted_blocks = num_full
        if state.saving is not None and request.num_computed_tokens >= state.saving[0]:
            # The step that ended at the checkpoint ran, and the runner saved the state:
            # the node ending there (split off if need be; the path is locked) holds it.
            end, slot = state.saving
            state.saving = None
            node = self.prefix_cache.insert(request.all_token_ids[:end], request.block_ids[: end // self.block_size],
                                            request.cache_key)
            self.prefix_cache.attach_state(node, slot)

    def _offer_tail(self, request: Request) -> None:
        """Offer the block after the request's last whole computed block, if computed
        tokens are in it, while the request's path is still locked (the cache hangs the
        tail from that path's end, and takes its own reference if it keeps it)."""
        num_computed = request.num_computed_tokens
        num_full = num_computed // self.block_size
        if num_computed % self.block_size and num_full < len(request.block_ids):
            self.prefix_cache.insert_tail(request.all_token_ids[:num_computed], request.block_ids[num_full],
                                          request.cache_key)

    def _copied(self, state: _CacheState) -> None:
        self.prefix_cache.unlock(state.copy_handle)
        state.copy, state.copy_handle = None, None

    def release_uncomputed(self, request: Request) -> int:
        """Return the blocks past the request's computed tokens (speculative decoding:
        they held only rejected drafts); returns how many. They are private to the
        request: the prefix cache holds only blocks of computed tokens (a request's
        partly filled one only once the request is freed)."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        surplus = request.block_ids[keep:]
        if surplus:
            self.pool.decref(surplus)
            del request.block_ids[keep:]
        return len(surplus)

    def free(self, request: Request) -> None:
        """Return the request's blocks; its computed full blocks stay in the prefix cache,
        and so does its last, partly filled one (a tail: the next chat turn, or the next
        round of a beam search, copies those tokens rather than computing them)."""
        self.cache_computed_blocks(request)
        state = self._cache_state.pop(request, None)
        if state is not None:
            if state.saving is not None:  # the step that was to save it never completed
                self.prefix_cache.release_state_slot(state.saving[1])
            if state.copy is not None:  # admitted, but its first step never launched
                self._copied(state)
            else:  # every computed token's KV is in its blocks (or its launched steps write it)
                self._offer_tail(request)  # under a window too: the cache declines it unless its blocks are cached
            self.prefix_cache.unlock(state.handle)
            del request.block_ids[:state.num_dropped]
        self.pool.decref(request.block_ids)
        request.block_ids = []

    def check_integrity(self, live_requests: list[Request]) -> None:
        """Every reference is accounted for by a live request or the prefix cache."""
        holders: dict[int, int] = {}
        for request in live_requests:
            state = self._cache_state.get(request)
            num_dropped = state.num_dropped if state is not None else 0
            held = request.block_ids[num_dropped:]
            if request.block_ids[:num_dropped] != [NO_BLOCK] * num_dropped or NO_BLOCK in held:
                raise BlockPoolError(f"request {request.request_id}: blocks let go are not its first {num_dropped}")
            if num_dropped and not 0 < num_dropped * self.block_size <= request.num_computed_tokens + 1 - self.window:
                raise BlockPoolError(f"request {request.request_id} let go of {num_dropped} blocks its window "
                                     f"of {self.window} keys at token {request.num_computed_tokens} still reads")
            for block_id in held:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in self.prefix_cache.held_blocks():
            holders[block_id] = holders.get(block_id, 0) + 1
        self.pool.check_integrity(holders)
        self.prefix_cache.check_integrity()
        live = set(live_requests)
        stale = [r.request_id for r in self._cache_state if r not in live]
        if stale:
            raise BlockPoolError(f"cache state kept for requests no longer live: {stale}")
        saving = {state.saving[1] for state in self._cache_state.values() if state.saving is not None}
        if saving != self.prefix_cache.reserved_state_slots():
            raise BlockPoolError(f"state slots being saved {sorted(saving)} != the cache's reserved "
                                 f"{sorted(self.prefix_cache.reserved_state_slots())}")
