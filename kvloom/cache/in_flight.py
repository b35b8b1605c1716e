"""Prompt blocks that running requests are computing right now.

When a waiting request's next uncached block is one of them, admitting it this step
would compute the same KV twice; waiting until the block lands in the prefix cache
turns that work into a hit. This is what makes requests that arrive together with
the same system prompt compute it once.

Blocks are identified by a chained hash of all tokens up to the block's end (a
collision can only delay an admission by a step, never change an output).
"""

from __future__ import annotations

from kvloom.request import Request


def _chain(tokens: list[int], block_size: int, num_blocks: int, salt: str | None) -> list[int]:
    """Hash of each of the first ``num_blocks`` blocks, chained through all before it
    and through the request's cache salt (another salt's blocks are no hit to wait for)."""
    hashes, value = [], hash(salt)
    for index in range(num_blocks):
        value = hash((value, tuple(tokens[index * block_size:(index + 1) * block_size])))
        hashes.append(value)
    return hashes


class NoPrefixesInFlight:
    """Without a sharing prefix cache there is nothing to wait for."""

    def add(self, request: Request) -> None:
        pass

    def covers_next_block(self, request: Request, num_cached_tokens: int) -> bool:
        return False


class PrefixesInFlight(NoPrefixesInFlight):
    """Built every step that has waiting requests, but hashed only when first asked:
    a step whose admission stops before any prefix check (seat limit, token budget)
    pays nothing for it."""

    def __init__(self, block_size: int, running: list[Request]) -> None:
        self.block_size = block_size
        self._pending: list[Request] = list(running)
        self._blocks: set[int] = set()

    def add(self, request: Request) -> None:
        """Count ``request``'s prompt blocks as in flight (it was just admitted)."""
        self._pending.append(request)

    def _index(self, request: Request) -> None:
        """Index the full prompt blocks ``request`` has yet to compute (prefilling only)."""
        if request.num_computed_tokens + 1 >= request.num_tokens:
            return  # decoding: its next block fills one token per step, not worth waiting for
        first = request.num_computed_tokens // self.block_size
        last = request.num_tokens // self.block_size
        if first < last:
            self._blocks.update(_chain(request.all_token_ids, self.block_size, last, request.cache_key)[first:])

    def covers_next_block(self, request: Request, num_cached_tokens: int) -> bool:
        for pending in self._pending:
            self._index(pending)
        self._pending.clear()
        if not self._blocks:
            return False
        next_block = num_cached_tokens // self.block_size
        # Only a block that a match could use later (the last token is always computed).
        if (next_block + 1) * self.block_size > request.num_tokens - 1:
            return False
        return _chain(request.all_token_ids, self.block_size, next_block + 1, request.cache_key)[-1] in self._blocks
