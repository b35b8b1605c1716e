"""Every fast attention path equals the pure-PyTorch reference on mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom.attention.base import make_backend
from kvloom.engine.output import ScheduledRequest, SchedulerOutput
from kvloom.request import Request
from kvloom.runner.forward_batch import ForwardBatch
from kvloom.sampling_params import SamplingParams

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


MIXED = [(0, 1), (0, 7), (0, 40), (5, 1), (31, 1), (16, 16), (33, 9), (63, 1), (2, 30), (100, 3)]
# Too few work items to fill the threads: the kernel splits items by kv head.
FEW = [(150, 1), (20, 5)]


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
        scheduled.append(ScheduledRequest(request, done, new))
    return SchedulerOutput(1, scheduled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 128)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("shapes", [MIXED, FEW], ids=["mixed", "few"])
def test_cpu_paged_matches_reference(dtype, heads, kv_heads, head_dim, block_size, shapes) -> None:
    torch.manual_seed(0)
    num_blocks = 400
    output = mixed_batch(block_size, num_blocks, seed=block_size + heads, shapes=shapes)
    batch = ForwardBatch.build(output, block_size, torch.device("cpu"))
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, dtype=dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    reference = make_backend("torch_ref", torch.device("cpu"), heads, kv_heads, head_dim)
    fast = make_backend("cpu_paged", torch.device("cpu"), heads, kv_heads, head_dim)
    cache_ref, cache_fast = cache.clone(), cache.clone()
    expected = reference.forward(q, k, v, cache_ref, batch, reference.prepare(batch))
    actual = fast.forward(q, k, v, cache_fast, batch, fast.prepare(batch))
    assert torch.equal(cache_ref, cache_fast)  # both wrote the same slots
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

