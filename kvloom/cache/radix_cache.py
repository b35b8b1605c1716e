"""RadixCache: a radix tree over token ids whose edges carry whole KV blocks.

Every edge holds a multiple of ``block_size`` tokens and exactly one block id per
``block_size`` tokens, so a path from the root spells a block-aligned token prefix
and lists the blocks that hold its KV (tails, below, are the one partly filled
kind). Nodes split only at block boundaries: a block
whose tokens differ anywhere is a different block, never a shared one.

Ownership: the tree holds one pool reference on every block it indexes; a block
appears at most once in the tree.

Locking: ``lock(node)`` pins the node and all its ancestors (the root excluded), so
``lock_count(node) == handle_locks(node) + sum(lock_count(child))``. Hence a node
with ``lock_count == 0`` has only unlocked descendants, and every unlocked block is
reachable by evicting least-recently-used unlocked leaves from the bottom up:
``num_evictable_blocks`` is exactly what ``evict`` can free.

Partial blocks: where a request's next block differs from every cached one, a match
also names the cached block whose first tokens continue the request's prefix furthest
(``PrefixMatch.partial``): the block after the match in the edge the walk stopped in,
or the first block of the deepest node's child that agrees longest. The KV manager
copies it into the request's first private block, so a prefix that ends inside a
block (a 1,000-token system prompt in blocks of 16) is reused to its last token, not
to its last whole block. The tree itself stays block-granular: a partial hit splits
nothing and refreshes no LRU time. Not for a state-space model's cache: its hits end
at checkpoints, and a checkpoint is at a node's end.

Tails: a request that ends (finished, aborted or preempted) leaves its last, partly
filled block to the tree as a *tail* (``insert_tail``): a one-block leaf whose key is
the 1..block_size-1 computed tokens in it, hung in ``tails`` of the node that ends at
its last whole block. A tail is only ever a partial block's source (it is never
walked into: the walk compares whole blocks), so the next turn of a chat, or a beam
search's next round, copies the previous request's last tokens instead of computing
them. A tail's block is never written again (its request is gone), and a node's end
never moves while it has tails (a split keeps the end with the lower half, and only a
leaf is trimmed, and a node with tails is not a leaf), so a tail stays valid until it
is evicted. A tail that another serves (a child block or a tail starting with its
tokens) is not kept, and unlocked tails that the new one serves are dropped for it.

Handles are nodes. A split keeps the existing node object as the lower half, so a
handle always means "the path down to this node's end", whatever splits happen
later. A handle must be locked before anything can evict (the KVCacheManager locks
right after ``match``); an unlocked handle may be evicted and is then refused.

Salts (vLLM's ``cache_salt``): a request with a salt matches and fills the tree of
its salt only, one root per salt beside the unsalted root; requests of different salts
(tenants) share no block and cannot learn from a hit's timing what another has sent. A
salted root goes when its last edge is evicted. Eviction, locks and statistics are
shared by all the trees.

State checkpoints (a state-space model's cache, ``state_slots`` given): KV alone does
not let a request skip a prefix when its model also has Mamba2 mixers, whose state
after the prefix must be there too. A node may then hold ``state_slot``, a state-pool
slot (cache/state_pool.py) with every mixer's state after the node's last token, and
a match ends at the deepest checkpointed node on the path. A split keeps the
checkpoint with the lower half (its end does not move); trimming or evicting a node
frees its checkpoint (the state after a shorter prefix is not that one). Checkpoints
are evicted on their own, least recently used first, among unlocked nodes; the node's
KV stays until the KV eviction takes it. Slots are free, reserved (a state is being
saved into them this step) or attached to exactly one node.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvloom.cache.block_pool import BlockPool, BlockPoolError
from kvloom.cache.prefix_cache import PartialBlock, PrefixCache, PrefixMatch


class RadixCacheError(BlockPoolError):
    """A radix-tree invariant or a lock/unlock contract was violated: a bug."""


@dataclass(slots=True, eq=False)  # eq=False: nodes hash by identity (handles, heaps)
class RadixNode:
    """One edge of the tree and the node it leads to."""

    key: list[int]  # edge tokens; len(key) == len(block_ids) * block_size
    block_ids: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first block
    tails: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by their whole key
    is_tail: bool = False  # a partly filled block under ``parent``'s end (key shorter than a block)
    lock_count: int = 0  # handle_locks + sum of the children's lock counts
    handle_locks: int = 0  # locks taken with this node as the handle
    last_access: int = 0
    detached: bool = False  # evicted: no longer in the tree
    state_slot: int | None = None  # the mixers' state after this node's last token
    salt: str | None = None  # a root's: the cache_salt whose tree it starts (None: unsalted)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class RadixCache(PrefixCache):
    """Prefix cache indexing KV blocks by block-aligned token prefixes, LRU eviction."""

    def __init__(self, pool: BlockPool, block_size: int, state_slots: range | None = None) -> None:
        """``state_slots``: the state-pool slots this cache may fill with checkpoints, for
        a state-space model (its hits need one); None for a KV-only cache."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode(key=[], block_ids=[], parent=None)  # the unsalted requests' tree
        self._salted: dict[str, RadixNode] = {}  # the other trees' roots, by salt (none empty)
        self._clock = itertools.count(1)  # logical LRU time: strictly increasing per operation
        self._indexed: set[int] = set()  # every block in the tree, for O(1) duplicate checks
        self._num_evictable_blocks = 0  # blocks of nodes with lock_count == 0
        self.keeps_states = state_slots is not None
        self._state_slots = state_slots if state_slots is not None else range(0)
        self._free_state_slots: list[int] = list(self._state_slots)
        self._reserved_state_slots: set[int] = set()
        self._num_cached_states = 0
        # Statistics (the engine derives its hit rate from these).
        self.num_match_queries = 0
        self.num_queried_tokens = 0
        self.num_matched_tokens = 0
        self.num_inserted_blocks = 0  # tails included
        self.num_inserted_tails = 0
        self.num_evicted_blocks = 0

    # ---- queries -----------------------------------------------------------------------
    def match(self, token_ids: list[int], salt: str | None = None) -> PrefixMatch:
        """Longest cached block-aligned prefix of ``token_ids`` in ``salt``'s tree.

        The handle covers exactly the matched blocks (the node is split if the match
        ends inside its edge); the matched path becomes most recently used.
        """
        node, in_edge, num_blocks, block_ids = self._walk(token_ids, self._root(salt))
        branch_tokens = num_blocks * self.block_size
        partial = None
        if self.keeps_states:
            node, num_blocks = self._checkpointed(node, in_edge, num_blocks)
            del block_ids[num_blocks:]
        else:
            # Found before the split, which keeps ``node`` as the lower half: the block
            # after the match is then that node's first, and the node its handle.
            partial = self._partial_block(node, in_edge, token_ids[branch_tokens:])
            if in_edge:
                node = self._split(node, in_edge)
        matched = num_blocks * self.block_size
        self.num_match_queries += 1
        self.num_queried_tokens += len(token_ids)
        self.num_matched_tokens += matched + (partial.num_tokens if partial is not None else 0)
        reason = self._miss_reason(token_ids, matched, in_edge, branch_tokens, partial)
        if self._is_root(node):
            return PrefixMatch(miss_reason=reason, branch_tokens=branch_tokens, partial=partial)
        self._touch(node)
        return PrefixMatch(block_ids, matched, node, reason, state_slot=node.state_slot,
                           branch_tokens=branch_tokens, partial=partial)

    def cached_prefix_length(self, token_ids: list[int], salt: str | None = None) -> int:
        """Tokens of ``token_ids`` a ``match`` would return, without any side effect
        (no split, no LRU refresh, no statistics): for cache-aware scheduling."""
        node, in_edge, num_blocks, _ = self._walk(token_ids, self._root(salt))
        if self.keeps_states:
            return self._checkpointed(node, in_edge, num_blocks)[1] * self.block_size
        matched = num_blocks * self.block_size
        partial = self._partial_block(node, in_edge, token_ids[matched:])
        return matched + (partial.num_tokens if partial is not None else 0)

    def _partial_block(self, node: RadixNode, in_edge: int, rest: list[int]) -> PartialBlock | None:
        """The cached block whose first tokens agree longest with ``rest``, the tokens
        after a walk's whole blocks (None if none agrees on the first). Candidates: the
        walk stopped ``in_edge`` blocks into ``node``'s edge, so its next block there;
        or at ``node``'s end, so its children's first blocks and its tails. That scan passes over every
        child once (a first-token check each; a node after a shared system prompt has one
        child per distinct question) and compares a block only for those that agree."""
        if not rest:
            return None
        bs, first = self.block_size, rest[0]
        if in_edge:
            candidates = [(node, in_edge)]
        else:
            candidates = [(child, 0) for key, child in node.children.items() if key[0] == first]
            candidates += [(tail, 0) for key, tail in node.tails.items() if key[0] == first]
        best: PartialBlock | None = None
        for candidate, index in candidates:
            # commonprefix compares in C (as the router's prefix tree does), on lists too.
            count = len(os.path.commonprefix([candidate.key[index * bs:(index + 1) * bs], rest[:bs]]))
            if count and (best is None or count > best.num_tokens):
                best = PartialBlock(candidate.block_ids[index], count, candidate)
        # A whole block in common would have been matched (the walk compares whole blocks).
        assert best is None or best.num_tokens < bs
        return best

    def _checkpointed(self, node: RadixNode, in_edge: int, num_blocks: int) -> tuple[RadixNode, int]:
        """The deepest node with a state checkpoint on a walk's path, and the blocks
        down to its end (the root and 0 if none): a checkpoint is at a node's end, so a
        walk that stops ``in_edge`` blocks into ``node`` can use its parent's at best."""
        if in_edge:
            assert node.parent is not None
            node, num_blocks = node.parent, num_blocks - in_edge
        while not self._is_root(node) and node.state_slot is None:
            assert node.parent is not None
            node, num_blocks = node.parent, num_blocks - node.num_blocks
        return node, num_blocks

    def _miss_reason(self, token_ids: list[int], matched: int, in_edge: int, branch_tokens: int,
                     partial: PartialBlock | None) -> str | None:
        """Why the hit is shorter than the block-aligned length of ``token_ids`` (with a
        partial block: shorter than ``token_ids``)."""
        if partial is None:
            return self._whole_block_miss(token_ids, matched, in_edge, branch_tokens)
        hit = matched + partial.num_tokens
        if hit == len(token_ids):
            return None
        return (f"prefix hit of {hit} tokens, {partial.num_tokens} of them copied from a cached block: "
                f"token {hit} differs from every cached continuation")

    def _whole_block_miss(self, token_ids: list[int], matched: int, in_edge: int, branch_tokens: int) -> str | None:
        if matched < branch_tokens:
            where = f"only after {matched} tokens" if matched else "nowhere on them"
            return (f"prefix hit of {matched} tokens: {branch_tokens} tokens of KV are cached, but the "
                    f"state-space layers' state is checkpointed {where}")
        aligned = len(token_ids) // self.block_size * self.block_size
        if matched == aligned:
            if matched == 0:
                return f"prompt shorter than one block ({len(token_ids)} < {self.block_size} tokens)"
            return None
        if matched == 0:
            return "no cached prefix"
        where = "diverges from the cached tokens" if in_edge else "has no cached continuation"
        return f"prefix hit of {matched} tokens; block {matched // self.block_size} {where}"

    def _root(self, salt: str | None, create: bool = False) -> RadixNode:
        """The root of ``salt``'s tree; a salt with none gets a new empty one, kept in the
        cache only with ``create`` (an insertion), else thrown away after the walk."""
        if salt is None:
            return self.root
        root = self._salted.get(salt)
        if root is None:
            root = RadixNode(key=[], block_ids=[], parent=None, salt=salt)
            if create:
                self._salted[salt] = root
        return root

    @staticmethod
    def _is_root(node: RadixNode) -> bool:
        return node.parent is None and not node.detached

    def _walk(self, token_ids: list[int], root: RadixNode) -> tuple[RadixNode, int, int, list[int]]:
        """Follow ``token_ids`` down the tree from ``root`` in whole blocks.

        Returns (node, in_edge, num_blocks, block_ids): the match ends ``in_edge`` blocks
        into ``node``'s edge (0: at the node's end), after ``num_blocks`` blocks in all.
        """
        bs = self.block_size
        node, pos, block_ids = root, 0, []
        while pos + bs <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            same = self._common_blocks(child.key, token_ids, pos)
            block_ids.extend(child.block_ids[:same])
            pos += same * bs
            if same < child.num_blocks:
                return child, same, pos // bs, block_ids
            node = child
        return node, 0, pos // bs, block_ids

    def _common_blocks(self, key: list[int], token_ids: list[int], start: int) -> int:
        """Whole blocks of ``key`` equal to ``token_ids[start:]`` (the first is known equal)."""
        if key == token_ids[start : start + len(key)]:  # the common case: the whole edge
            return len(key) // self.block_size
        bs, count = self.block_size, 1
        while (count + 1) * bs <= len(key) and start + (count + 1) * bs <= len(token_ids):
            lo = count * bs
            if key[lo : lo + bs] != token_ids[start + lo : start + lo + bs]:
                break
            count += 1
        return count

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, token_ids: list[int], block_ids: list[int], salt: str | None = None) -> RadixNode | None:
        """Index ``token_ids`` (whole blocks) in ``salt``'s tree and return the deepest
        node covering them.

        Blocks already indexed under the same tokens are kept, even when the caller
        computed its own copy (two requests filled the same prefix concurrently); only
        the caller's blocks for the new suffix are indexed and gain a reference.
        """
        bs = self.block_size
        if len(token_ids) != len(block_ids) * bs:
            raise ValueError(
                f"insert needs len(token_ids) == len(block_ids) * block_size, got "
                f"{len(token_ids)} tokens for {len(block_ids)} blocks of {bs}"
            )
        if not block_ids:
            return None
        node, in_edge, num_blocks, _ = self._walk(token_ids, self._root(salt, create=True))
        if in_edge:
            node = self._split(node, in_edge)
        if num_blocks < len(block_ids):
            node = self._add_leaf(node, token_ids[num_blocks * bs :], block_ids[num_blocks:])
        self._touch(node)
        return node

    def insert_tail(self, token_ids: list[int], block_id: int, salt: str | None = None) -> bool:
        """Keep ``block_id``, which holds the KV of the last ``len(token_ids) % block_size``
        tokens of ``token_ids``, as a tail of the node that ends at their last whole block.

        Returns whether the tree took it (and a reference on it). It does not where the
        whole blocks before it are not all cached (nothing to hang it from), for a cache
        that keeps states (a tail serves no checkpoint), or where a cached block already
        starts with its tokens. Unlocked tails whose tokens are a prefix of its own serve
        nothing it does not, and are dropped for it.
        """
        bs = self.block_size
        whole = len(token_ids) // bs * bs
        rest = token_ids[whole:]
        if not rest:
            raise ValueError(f"insert_tail needs a partly filled last block, got {len(token_ids)} tokens "
                             f"in blocks of {bs}")
        if self.keeps_states:
            return False
        node, in_edge, num_blocks, _ = self._walk(token_ids[:whole], self._root(salt))
        if num_blocks * bs < whole or self._serves(node, in_edge, rest):
            return False
        if block_id in self._indexed:
            raise RadixCacheError(f"block {block_id} is already indexed under other tokens")
        if in_edge:
            node = self._split(node, in_edge)
        elif whole == 0:
            node = self._root(salt, create=True)  # a salt's first tail starts its tree
        # Unlocked tails whose tokens are a prefix of this one's give way to it. They go
        # after it joins: a salt's root that held only them would be let go, emptied,
        # and the new tail left under a root the cache no longer holds.
        dominated = [t for t in node.tails.values() if t.lock_count == 0 and rest[: len(t.key)] == t.key]
        self.pool.incref([block_id])
        tail = RadixNode(key=list(rest), block_ids=[block_id], parent=node, is_tail=True)
        node.tails[tuple(rest)] = tail
        self._indexed.add(block_id)
        self._num_evictable_blocks += 1  # a new tail is unlocked
        for victim in dominated:
            self._forget(victim)
            self._num_evictable_blocks -= 1
        self.num_inserted_blocks += 1
        self.num_inserted_tails += 1
        self._touch(tail)
        return True

    def _serves(self, node: RadixNode, in_edge: int, rest: list[int]) -> bool:
        """Whether a cached block after a walk's end already starts with ``rest``."""
        if in_edge:
            start = in_edge * self.block_size
            return node.key[start : start + len(rest)] == rest
        return any(other.key[: len(rest)] == rest for other in (*node.children.values(), *node.tails.values()))

    def _add_leaf(self, parent: RadixNode, key: list[int], block_ids: list[int]) -> RadixNode:
        reused = [b for b in block_ids if b in self._indexed]
        if reused:
            raise RadixCacheError(f"blocks {reused} are already indexed under other tokens")
        self.pool.incref(block_ids)
        leaf = RadixNode(key=list(key), block_ids=list(block_ids), parent=parent)
        parent.children[tuple(key[: self.block_size])] = leaf
        self._indexed.update(leaf.block_ids)
        self._num_evictable_blocks += leaf.num_blocks  # a new leaf is unlocked
        self.num_inserted_blocks += leaf.num_blocks
        return leaf

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node``'s edge after ``num_blocks`` blocks; return the new upper node.

        ``node`` keeps the lower half, so handles to it stay valid; the upper node is on
        every path through ``node``, so it inherits its lock count and LRU time.
        """
        bs, parent = self.block_size, node.parent
        assert parent is not None and 0 < num_blocks < node.num_blocks
        cut = num_blocks * bs
        upper = RadixNode(key=node.key[:cut], block_ids=node.block_ids[:num_blocks], parent=parent,
                          lock_count=node.lock_count, last_access=node.last_access)
        parent.children[tuple(upper.key[:bs])] = upper
        node.key, node.block_ids, node.parent = node.key[cut:], node.block_ids[num_blocks:], upper
        upper.children[tuple(node.key[:bs])] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        now = next(self._clock)
        for on_path in self._path(node):
            on_path.last_access = now

    def _path(self, node: RadixNode | None) -> Iterator[RadixNode]:
        """``node`` and its ancestors up to, not including, the root."""
        while node is not None and not self._is_root(node):
            yield node
            node = node.parent

    # ---- locking -----------------------------------------------------------------------
    def lock(self, handle: object | None) -> None:
        """Pin ``handle``'s path: none of its blocks can be evicted until ``unlock``."""
        node = self._node(handle, "lock")
        if node is None:
            return
        node.handle_locks += 1
        for on_path in self._path(node):
            if on_path.lock_count == 0:
                self._num_evictable_blocks -= on_path.num_blocks
            on_path.lock_count += 1

    def unlock(self, handle: object | None) -> None:
        """Release one ``lock`` of ``handle``; unlocking more often than locking raises."""
        node = self._node(handle, "unlock")
        if node is None:
            return
        if node.handle_locks <= 0:
            raise RadixCacheError("unlock of a handle that is not locked")
        node.handle_locks -= 1
        for on_path in self._path(node):
            on_path.lock_count -= 1  # was >= 1: ancestors count every lock below them
            if on_path.lock_count == 0:
                self._num_evictable_blocks += on_path.num_blocks

    def _node(self, handle: object | None, action: str) -> RadixNode | None:
        if handle is None or (isinstance(handle, RadixNode) and self._is_root(handle)):
            return None
        if not isinstance(handle, RadixNode):
            raise TypeError(f"{action} expects a handle from this cache, got {type(handle).__name__}")
        if handle.detached:
            raise RadixCacheError(f"{action} of an evicted node: lock a match before evicting")
        return handle

    def unindex_after(self, handle: object | None, num_tokens: int) -> tuple[object | None, int]:
        """See PrefixCache. Walks up from the handle while the node is a leaf its lock
        alone pins, forgetting each node that starts at or past ``num_tokens`` and
        trimming the one that straddles it; the lock then moves to the deepest node left
        on the path (the root: none)."""
        node = self._node(handle, "unindex")
        if node is None:
            return None, 0
        end = self._depth(node)
        self.unlock(node)
        while not self._is_root(node) and self._is_evictable_leaf(node) and end > num_tokens:
            start = end - len(node.key)
            parent = node.parent
            assert parent is not None
            if start < num_tokens:  # trim to num_tokens; the node keeps its place (and is the new end)
                keep = (num_tokens - start) // self.block_size
                dropped = node.block_ids[keep:]
                self._indexed.difference_update(dropped)
                self.pool.decref(dropped)
                self._drop_state(node)
                del node.block_ids[keep:]
                del node.key[keep * self.block_size:]
                self._num_evictable_blocks -= len(dropped)
                end = num_tokens
                break
            self._num_evictable_blocks -= node.num_blocks
            self._forget(node)
            node, end = parent, start
        if self._is_root(node):
            return None, 0
        self.lock(node)
        return node, end

    def _depth(self, node: RadixNode) -> int:
        """Tokens on the path from the root to ``node``'s end."""
        return sum(len(on_path.key) for on_path in self._path(node))

    # ---- eviction ----------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` unlocked blocks, least recently used leaves first.

        A leaf is trimmed from its end when fewer than all its blocks are needed (its
        remaining prefix stays valid), so exactly ``min(num_blocks, evictable)`` are
        dropped. Parents left childless and unlocked become candidates in turn.
        """
        if num_blocks <= 0:
            return 0
        order = itertools.count()  # tie-break: heap entries never compare nodes
        heap = [(n.last_access, next(order), n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - evicted, leaf.num_blocks)
            if take < leaf.num_blocks:  # never a tail: it is one block
                dropped = leaf.block_ids[-take:]
                self._indexed.difference_update(dropped)
                self.pool.decref(dropped)
                self._drop_state(leaf)  # its end moves: the state was after it
                del leaf.block_ids[-take:]
                del leaf.key[-take * self.block_size :]
            else:
                parent = leaf.parent
                self._forget(leaf)
                if parent is not None and self._is_evictable_leaf(parent):
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
            evicted += take
        self._num_evictable_blocks -= evicted
        self.num_evicted_blocks += evicted
        return evicted

    def _forget(self, leaf: RadixNode) -> None:
        """Take an unlocked leaf (a tail or a childless edge) out of the tree and give
        back its blocks and checkpoint; the caller keeps the evictable count."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and not leaf.tails and leaf.lock_count == 0
        self._indexed.difference_update(leaf.block_ids)
        self.pool.decref(leaf.block_ids)
        self._drop_state(leaf)
        if leaf.is_tail:
            del parent.tails[tuple(leaf.key)]
        else:
            del parent.children[tuple(leaf.key[: self.block_size])]
        leaf.detached, leaf.parent = True, None
        if parent.salt is not None and not parent.children and not parent.tails:  # an emptied salt's tree
            del self._salted[parent.salt]

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return not self._is_root(node) and not node.children and not node.tails and node.lock_count == 0

    # ---- state checkpoints -------------------------------------------------------------
    def reserve_state_slot(self) -> int | None:
        if not self._free_state_slots:
            victims = [n for n in self._nodes() if n.state_slot is not None and n.lock_count == 0]
            if not victims:
                return None
            self._drop_state(min(victims, key=lambda n: n.last_access))
        slot = self._free_state_slots.pop()
        self._reserved_state_slots.add(slot)
        return slot

    def attach_state(self, handle: object | None, slot: int) -> None:
        """A node that has a checkpoint already keeps it (the same tokens' state, saved
        by a request that got there first); ``slot`` is then free again."""
        node = self._node(handle, "attach_state")
        if slot not in self._reserved_state_slots:
            raise RadixCacheError(f"state slot {slot} is attached without being reserved")
        self._reserved_state_slots.remove(slot)
        if node is None or node.state_slot is not None:
            self._free_state_slots.append(slot)
            return
        node.state_slot = slot
        self._num_cached_states += 1

    def release_state_slot(self, slot: int) -> None:
        if slot not in self._reserved_state_slots:
            raise RadixCacheError(f"state slot {slot} is released without being reserved")
        self._reserved_state_slots.remove(slot)
        self._free_state_slots.append(slot)

    def reserved_state_slots(self) -> set[int]:
        return set(self._reserved_state_slots)

    @property
    def num_cached_states(self) -> int:
        return self._num_cached_states

    def _drop_state(self, node: RadixNode) -> None:
        if node.state_slot is not None:
            self._free_state_slots.append(node.state_slot)
            node.state_slot = None
            self._num_cached_states -= 1

    # ---- accounting --------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._indexed)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable_blocks

    @property
    def hit_rate(self) -> float:
        """Matched tokens over queried tokens, over all ``match`` calls so far."""
        return self.num_matched_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def held_blocks(self) -> list[int]:
        return [b for node in self._nodes() for b in node.block_ids]

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node except the roots, parents before children."""
        stack = [child for root in self._roots() for child in (*root.children.values(), *root.tails.values())]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
            stack.extend(node.tails.values())

    def _roots(self) -> list[RadixNode]:
        return [self.root, *self._salted.values()]

    def check_integrity(self) -> None:
        """Edges are whole blocks, links agree, lock counts add up, counters match,
        no block is indexed twice and every indexed block is live in the pool."""
        bs, roots = self.block_size, self._roots()
        for root in roots:
            if root.key or root.block_ids or root.lock_count or root.handle_locks or root.parent:
                raise RadixCacheError("a root must be empty and unlocked")
            if root is not self.root and ((not root.children and not root.tails)
                                          or self._salted.get(root.salt or "") is not root):
                raise RadixCacheError(f"salted root {root.salt!r} is empty or filed under another salt")
        if self.root.salt is not None:
            raise RadixCacheError("the unsalted root has a salt")
        seen: set[int] = set()
        num_evictable = 0
        for node in [*roots, *self._nodes()]:
            for first, child in node.children.items():
                if child.parent is not node or child.detached or child.is_tail:
                    raise RadixCacheError(f"child {first} is not linked back to its parent")
                if first != tuple(child.key[:bs]) or len(first) != bs:
                    raise RadixCacheError(f"child keyed {first} starts with {child.key[:bs]}")
            for key, tail in node.tails.items():
                if tail.parent is not node or tail.detached or not tail.is_tail or key != tuple(tail.key):
                    raise RadixCacheError(f"tail {key} is not linked back to its parent under its tokens")
            if node.parent is None:  # a root
                continue
            if node.is_tail:
                if not 0 < len(node.key) < bs or node.num_blocks != 1 or node.children or node.tails \
                        or node.state_slot is not None:
                    raise RadixCacheError(f"tail of {len(node.key)} tokens in {node.num_blocks} blocks "
                                          f"is not one partly filled leaf block")
            elif not node.block_ids or len(node.key) != node.num_blocks * bs:
                raise RadixCacheError(f"edge of {len(node.key)} tokens holds {node.num_blocks} blocks")
            below = sum(child.lock_count for child in (*node.children.values(), *node.tails.values()))
            if node.handle_locks < 0 or node.lock_count != node.handle_locks + below:
                raise RadixCacheError(
                    f"lock count {node.lock_count} != {node.handle_locks} own + {below} below"
                )
            for block_id in node.block_ids:
                if block_id in seen:
                    raise RadixCacheError(f"block {block_id} is indexed twice")
                if self.pool.ref_count(block_id) < 1:
                    raise RadixCacheError(f"indexed block {block_id} is free in the pool")
                seen.add(block_id)
            if node.lock_count == 0:
                num_evictable += node.num_blocks
        if seen != self._indexed:
            raise RadixCacheError(f"index has {len(self._indexed)} blocks, tree has {len(seen)}")
        self._check_state_slots()
        if num_evictable != self._num_evictable_blocks:
            raise RadixCacheError(
                f"counter says {self._num_evictable_blocks} evictable, tree has {num_evictable}"
            )

    def _check_state_slots(self) -> None:
        """Every checkpoint slot is free, reserved or attached to one node, exactly once."""
        attached = [n.state_slot for n in self._nodes() if n.state_slot is not None]
        parts = [*self._free_state_slots, *self._reserved_state_slots, *attached]
        if sorted(parts) != list(self._state_slots):
            raise RadixCacheError(f"state checkpoint slots: {len(self._free_state_slots)} free, "
                                  f"{len(self._reserved_state_slots)} reserved and {len(attached)} attached "
                                  f"are not each of {self._state_slots} once")
        if len(attached) != self._num_cached_states:
            raise RadixCacheError(f"counter says {self._num_cached_states} checkpoints, tree has {len(attached)}")

