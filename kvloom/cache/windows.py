"""What a sliding window in every layer lets a request let go of, in blocks: the two
counts the KV cache manager (which lets go) and the admission checks (which count what a
request holds at once) share. Torch-free, importing nothing: the server's checks use it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_dead_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The leading blocks no query from position ``num_computed_tokens`` on reads: the
    query at p reads keys p - window + 1 .. p, so a block ending at or before the next
    query's first key is dead (0 without a window)."""
    if not window:
        return 0
    return max(0, num_computed_tokens + 1 - window) // block_size


def blocks_held_at_most(block_size: int, window: int, num_prompt_tokens: int, max_tokens: int,
                        chunk_tokens: int = 0) -> int:
    """The most KV blocks a request holds at once: its whole sequence's, or under a
    ``window`` fewer: the blocks indexed before its window first passed one (its prompt,
    or a window and a block, pinned until the window passes them too), and the blocks
    from its window's first key to the end of a step's ``chunk_tokens``."""
    whole = cdiv(num_prompt_tokens + max_tokens, block_size)
    if not window:
        return whole
    indexed = cdiv(max(num_prompt_tokens, window + block_size), block_size)
    moving = cdiv(window + chunk_tokens, block_size) + 2  # a window's first and a chunk's last block part full
    return min(whole, indexed + moving)
