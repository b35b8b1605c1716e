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
