"""Mixed attention batches for the backend tests: requests mid-decode, mid-chunk,
fresh prefills and chunks after a cached prefix, on shuffled blocks."""

from __future__ import annotations

import random

from kvloom.batch import ScheduledRequest, SchedulerOutput
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

MIXED = [(0, 1), (0, 7), (0, 40), (5, 1), (31, 1), (16, 16), (33, 9), (63, 1), (2, 30), (100, 3)]
# Too few work items to fill the threads: the kernel splits items by kv head.
FEW = [(150, 1), (20, 5)]
# One long context among short decodes: one whole item would cost more than a thread's
# share, so the kernel splits items by kv head (and takes the longest walks first).
UNEVEN = [(9, 1), (3, 1), (12, 1), (300, 1), (6, 1)]


def mixed_batch(block_size: int, num_blocks: int, seed: int, shapes=MIXED):
    """Requests mid-decode, mid-chunk, fresh prefills and prefix-hit style chunks;
    ``shapes`` lists (tokens already computed, tokens this step)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    scheduled = []
    for i, (done, new) in enumerate(shapes):
        total = done + new
        request = Request(f"r{i}", [rng.randrange(100) for _ in range(total)], SamplingParams())
        request.block_ids = [free.pop() for _ in range(-(-total // block_size))]
        scheduled.append(ScheduledRequest.of(request, done, new))
    return SchedulerOutput(1, scheduled)


def batches_with_blocks_let_go(block_size: int, num_blocks: int, seed: int, shapes, window: int, device):
    """The same mixed batch twice, as ForwardBatches: with every block, and with the blocks
    behind each sequence's window (wholly before its first query's first key) let go as the
    KV cache manager lets them go (``NO_BLOCK``, which the batch sends as block 0). Block 0
    is no sequence's: a test fills it with NaN, so that reading it shows."""
    from kvloom.batch import ForwardBatch
    from kvloom.cache.windows import num_dead_blocks
    from kvloom.request import NO_BLOCK

    output = mixed_batch(block_size, num_blocks, seed, shapes)
    used = {block for item in output.scheduled for block in item.request.block_ids}
    unused = next(block for block in range(num_blocks) if block not in used)
    for item in output.scheduled:  # block 0 for none of them: swap it with an unused one
        item.request.block_ids = [unused if block == 0 else block for block in item.request.block_ids]
    whole = ForwardBatch.build(output, block_size, device)
    for item in output.scheduled:
        dead = num_dead_blocks(item.start, window, block_size)
        item.request.block_ids[:dead] = [NO_BLOCK] * dead
    return whole, ForwardBatch.build(output, block_size, device)
