"""The prefix-cache seam: index KV blocks of earlier requests by their token ids.

The engine talks to one ``PrefixCache``; ``NoPrefixCache`` is the null object used
when caching is off, so no caller ever checks a "disabled" flag.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PartialBlock:
    """The tokens of a cached block that a match can use past its whole blocks.

    The request's next block differs from every cached one, but the first
    ``num_tokens`` (0 < num_tokens < block_size) of cached block ``block_id`` are its
    own next tokens, after the same prefix, so their KV is the request's KV bit for bit
    (the kernels are batch-invariant). The request cannot share the block (it would
    write into it), so its first private block starts as a copy of this one. ``handle``
    pins the block until the step that copies it has been launched.
    """

    block_id: int
    num_tokens: int
    handle: object


@dataclass(slots=True)
class PrefixMatch:
    """The longest cached block-aligned prefix of a token sequence, and the cached
    block (if any) that serves some of the tokens after it.

    ``handle`` is opaque to callers: pass it back to ``lock``/``unlock``.
    ``miss_reason`` explains a zero or short hit ("cache disabled", "shorter than one
    block", ...) so a user can see why a prefix they expected was not used.
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    handle: object | None = None
    miss_reason: str | None = None
    shareable: bool = True  # False: the request may not use cached blocks at all (nothing to wait for)
    # A cache that keeps state checkpoints (state-space models): the checkpoint slot
    # holding every mixer's state after ``num_tokens`` (None: no hit), and the tokens of
    # KV the tree holds for this prefix, checkpointed or not (>= num_tokens): where the
    # request leaves the tree, a checkpoint would serve the next request to share it.
    state_slot: int | None = None
    branch_tokens: int = 0
    partial: PartialBlock | None = None

    @property
    def num_hit_tokens(self) -> int:
        """Tokens the request need not compute: its whole shared blocks, then the
        partial block's tokens."""
        return self.num_tokens + (self.partial.num_tokens if self.partial is not None else 0)


class PrefixCache(ABC):
    """Holds one reference (in the BlockPool) on every block it indexes."""

    # Whether matches can ever hit; the scheduler waits for in-flight prefixes only if so.
    shares_prefixes: bool = True
    # Whether a hit needs a state checkpoint as well as KV (a state-space model's cache,
    # cache/radix_cache.py); such a cache serves only prefixes that end at a checkpoint.
    keeps_states: bool = False

    @abstractmethod
    def match(self, token_ids: list[int], salt: str | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, in whole blocks, and a cached block
        whose first tokens continue it (``PrefixMatch.partial``) if the cache can tell;
        refreshes the whole blocks' LRU time. Only what was inserted with the same
        ``salt`` (vLLM's ``cache_salt``: one tenant's) can match."""

    @abstractmethod
    def lock(self, handle: object | None) -> None:
        """Pin the matched path: locked blocks are never evicted."""

    @abstractmethod
    def unlock(self, handle: object | None) -> None:
        """Release one lock taken with ``lock``."""

    @abstractmethod
    def insert(self, token_ids: list[int], block_ids: list[int], salt: str | None = None) -> object | None:
        """Index the full blocks of ``token_ids`` (len(block_ids) blocks) and return
        the handle of the deepest node covering them. Blocks newly indexed gain a
        reference; blocks already indexed under the same tokens are left alone."""

    def insert_tail(self, token_ids: list[int], block_id: int, salt: str | None = None) -> bool:
        """Offer the partly filled block ``block_id``, which holds the last
        ``len(token_ids) % block_size`` tokens of ``token_ids`` (the whole blocks before
        them inserted), as a source for later partial hits. Returns whether the cache took
        a reference on it; a cache that cannot use it declines."""
        return False

    def unindex_after(self, handle: object | None, num_tokens: int) -> tuple[object | None, int]:
        """Give back what only ``handle``'s lock keeps indexed past the path's first
        ``num_tokens`` (a multiple of the block size): the blocks of the handle's own
        leaf chain there, which no other request locks and nothing hangs from (whoever
        locked the handle still holds its own references on them). The caller's lock
        moves to the path that stays; returns its handle and its length in tokens."""
        return handle, 0

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` unlocked least-recently-used blocks; returns how many."""

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds a reference on."""

    @property
    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Cached blocks that ``evict`` could free right now."""

    @abstractmethod
    def held_blocks(self) -> list[int]:
        """Every block the cache holds a reference on (for integrity checks)."""

    def cached_prefix_length(self, token_ids: list[int], salt: str | None = None) -> int:
        """Tokens of ``token_ids`` a match would serve (``num_hit_tokens``), without
        touching LRU or stats (for cache-aware scheduling)."""
        return 0

    def check_integrity(self) -> None:  # noqa: B027 - a cache with no structure has nothing to check
        """Raise if the cache's own structure is inconsistent."""

    # State checkpoints, for a cache that ``keeps_states`` (the rest never has any).
    def reserve_state_slot(self) -> int | None:
        """A checkpoint slot for a state about to be saved (evicting the least recently
        used unlocked checkpoint if none is free), or None if every one is in use."""
        return None

    def attach_state(self, handle: object | None, slot: int) -> None:
        """The reserved ``slot`` now holds the state after ``handle``'s last token."""
        raise TypeError(f"{type(self).__name__} keeps no state checkpoints")

    def release_state_slot(self, slot: int) -> None:
        """Give back a reserved slot that was never attached."""
        raise TypeError(f"{type(self).__name__} keeps no state checkpoints")

    def reserved_state_slots(self) -> set[int]:
        """Slots reserved and not yet attached or released (for integrity checks)."""
        return set()

    @property
    def num_cached_states(self) -> int:
        """State checkpoints attached to cached prefixes."""
        return 0


class NoPrefixCache(PrefixCache):
    """Prefix caching disabled: every match misses, nothing is ever held."""

    shares_prefixes = False

    def match(self, token_ids: list[int], salt: str | None = None) -> PrefixMatch:
        return PrefixMatch(miss_reason="prefix cache disabled")

    def lock(self, handle: object | None) -> None:
        pass

    def unlock(self, handle: object | None) -> None:
        pass

    def insert(self, token_ids: list[int], block_ids: list[int], salt: str | None = None) -> object | None:
        return None

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return 0

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    def held_blocks(self) -> list[int]:
        return []
