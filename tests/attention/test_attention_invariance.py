"""The CPU kernel's output for a query does not depend on how its sequence is cut into
steps: a fresh prefill, chunks of any size and one-token decodes give the same bits
for the same query at the same position, whatever other sequences share the call; in
the paired bf16 layout (the engine's default) and in the token-major ones."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom.attention.registry import make_backend
from kvloom.batch import ForwardBatch, ScheduledRequest, SchedulerOutput
from kvloom.kernels import paged_attention as kernels
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

HEADS, KV_HEADS, NUM_BLOCKS = 9, 3, 64
LENGTH = 70  # the sequence under test: 4.4 blocks of 16


def attend(backend, cache, history, sequences: list[tuple[list[int], int, int]], window: int = 0) -> list[torch.Tensor]:
    """One kernel call over ``sequences`` = (block ids, tokens done, tokens this step);
    each token's q/k/v come from ``history`` by (block table, position), so every call
    sees the same values. Returns each sequence's output rows."""
    q_all, k_all, v_all = history
    scheduled = []
    for i, (blocks, done, new) in enumerate(sequences):
        request = Request(f"s{i}", [1] * (done + new), SamplingParams())
        request.block_ids = list(blocks)
        scheduled.append(ScheduledRequest.of(request, done, new))
    batch = ForwardBatch.build(SchedulerOutput(1, scheduled), cache.shape[2], torch.device("cpu"))
    slots = batch.slot_mapping.long()
    out = backend.forward(q_all[slots], k_all[slots], v_all[slots], cache, batch, backend.prepare(batch), window)
    rows, start = [], 0
    for _, _, new in sequences:
        rows.append(out[start:start + new])
        start += new
    return rows


# (dtype, head_dim, block_size): the paired layout (head_dim 64, and Gemma's 256), and
# token-major bf16 and float32.
LAYOUTS = [(torch.bfloat16, 64, 16), (torch.bfloat16, 256, 16), (torch.bfloat16, 16, 16), (torch.float32, 64, 5)]


@pytest.fixture(params=LAYOUTS, ids=["bf16-paired", "bf16-paired-256", "bf16-token-major", "f32-token-major"])
def setup(request, paired_path):
    dtype, head_dim, block_size = request.param
    torch.manual_seed(0)
    backend = make_backend("cpu_paged", torch.device("cpu"), HEADS, KV_HEADS, head_dim)
    num_blocks = NUM_BLOCKS * 16 // block_size
    cache = torch.zeros(2, num_blocks, block_size, KV_HEADS, head_dim, dtype=dtype)
    slots = num_blocks * block_size  # q/k/v of every slot, fixed
    history = (torch.randn(slots, HEADS, head_dim).to(dtype), torch.randn(slots, KV_HEADS, head_dim).to(dtype),
               torch.randn(slots, KV_HEADS, head_dim).to(dtype))
    blocks = random.Random(1).sample(range(num_blocks), num_blocks)
    per_sequence = -(-100 // block_size)  # every sequence below fits in 100 tokens
    return backend, cache, history, blocks[:per_sequence], [blocks[per_sequence * (i + 1):per_sequence * (i + 2)]
                                                             for i in range(3)]


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (21, 2.0)], ids=["whole", "window-21", "softcap"])
def test_prefill_chunks_and_decodes_give_the_same_bits(setup, window, softcap) -> None:
    """(A sliding window of 21 keys starts mid-tile, a different one for every query;
    Gemma 2's softcap bends each score on its own.)"""
    backend, cache, history, table, spare = setup
    backend.softcap = softcap
    fresh = attend(backend, cache, history, [(table, 0, LENGTH)], window)[0]
    for cuts in ([23, 23, 24], [1] * 10 + [60], [16, 16, 16, 16, 6], [69, 1]):
        done = 0
        for new in cuts:
            part = attend(backend, cache, history, [(table, done, new)], window)[0]
            assert torch.equal(part, fresh[done:done + new]), f"cuts {cuts}: tokens {done}..{done + new}"
            done += new
    # Decodes and chunks of this sequence batched with others of other shapes.
    others = [(spare[0], 0, 20), (spare[1], 30, 1), (spare[2], 11, 33)]
    for done, new in [(69, 1), (40, 30), (0, LENGTH), (64, 6)]:
        rows = attend(backend, cache, history, others[:1] + [(table, done, new)] + others[1:], window)
        assert torch.equal(rows[1], fresh[done:done + new]), f"batched: tokens {done}..{done + new}"


def test_decodes_sharing_leading_blocks_give_their_own_bits(setup) -> None:
    """Decodes whose block tables start with the same blocks (a cached prefix) walk those
    blocks together in the paired kernel, each query's state suspended and resumed over
    its own blocks: the same bits as each one alone, and as its fresh prefill."""
    backend, cache, history, table, spare = setup
    size = cache.shape[2]
    pool = random.Random(2).sample(range(cache.shape[1]), cache.shape[1])
    prefix, own = pool[:80 // size], iter(pool[80 // size:])  # 80 shared tokens (5 blocks of 16)
    deeper = prefix + [next(own) for _ in range(48 // size)]  # two sequences share more

    def blocks(shared: list[int], length: int) -> list[int]:
        return shared + [next(own) for _ in range(-(-length // size) - len(shared))]

    # (block table, tokens done, tokens this step)
    decodes = [(blocks(prefix, 90), 89, 1), (blocks(prefix, 110), 109, 1), (prefix, 79, 1),
               (blocks(prefix, 98), 95, 3), (blocks(deeper, 140), 139, 1), (blocks(deeper, 129), 128, 1)]
    partly = (blocks(prefix[:2], 96), 95, 1)  # shares 2 blocks: too few to join
    prefill = (blocks(prefix, 100), 80, 20)  # a chunk: walks alone
    sequences = decodes + [partly, prefill]
    fresh = [attend(backend, cache, history, [(t, 0, done + new)])[0][done:] for t, done, new in sequences]
    alone = [attend(backend, cache, history, [sequence])[0] for sequence in sequences]
    order = [3, 7, 0, 6, 5, 1, 4, 2]
    together = attend(backend, cache, history, [sequences[i] for i in order])
    for position, i in enumerate(order):
        assert torch.equal(alone[i], fresh[i]), f"sequence {i} alone"
        assert torch.equal(together[position], alone[i]), f"sequence {i} in the batch"
    if backend.paired_layout(cache):
        tables = torch.zeros(len(sequences), max(len(t) for t, _, _ in sequences), dtype=torch.int32)
        for row, (t, _, _) in enumerate(sequences):
            tables[row, :len(t)] = torch.tensor(t)
        seq_lens = torch.tensor([done + new for _, done, new in sequences], dtype=torch.int32)
        query_lens = torch.tensor([new for _, _, new in sequences], dtype=torch.int32)
        assert kernels.cascade_members(tables, seq_lens, query_lens, size) == len(decodes)
