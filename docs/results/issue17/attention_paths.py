"""Paired-layout attention alone, 30 layers' worth of calls (the default model's 9 query
and 3 kv heads of 64 dims, blocks of 16 scattered over the pool), on each path this CPU
has: decode at batch 64 and context 300, prefill 8 x 256 and 1 x 512 at context 1,024,
and 100 decodes at context 1,060 whose first 1,056 tokens are one shared prefix (the
shared walk) or 100 different ones. Best of 5, ms. HUGE=1 puts the caches on 2 MiB pages,
as the engine's pool is.

    .venv/bin/python docs/results/issue17/attention_paths.py
"""

from __future__ import annotations

import math
import os
import time

import torch

from kvloom.kernels import huge_pages
from kvloom.kernels import paged_attention as kernels

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def case(batch: int, context: int, query_len: int, shared: int = 0):
    blocks = -(-context // BLOCK)
    shared_blocks = shared // BLOCK
    total = shared_blocks + batch * (blocks - shared_blocks)
    shape = (2, total, BLOCK, KV_HEADS, DIM)
    if os.environ.get("HUGE") == "1":  # as the engine's pool: on 2 MiB pages (kernels/huge_pages.py)
        caches = [huge_pages.empty_on_huge_pages(math.prod(shape), torch.bfloat16).view(shape).normal_()
                  for _ in range(LAYERS)]
    else:
        caches = [torch.empty(shape, dtype=torch.bfloat16).normal_() for _ in range(LAYERS)]
    order = torch.randperm(total).int()
    tables = torch.empty(batch, blocks, dtype=torch.int32)
    tables[:, :shared_blocks] = order[:shared_blocks]
    tables[:, shared_blocks:] = order[shared_blocks:].view(batch, blocks - shared_blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_lens = torch.full((batch,), query_len, dtype=torch.int32)
    query_start = torch.arange(batch, dtype=torch.int32) * query_len
    q = torch.randn(batch * query_len, HEADS, DIM).bfloat16()
    flops = LAYERS * batch * query_len * HEADS * context * DIM * 4
    return lambda: [kernels.paged_attention(q, c, tables, seq_lens, query_start, query_lens, 0.125, True)
                    for c in caches], flops


def best_ms(fn) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    kernels.load()
    paths = [isa for isa in kernels.PAIRED_ISAS if kernels.set_paired_isa(isa) == isa]
    cases = {"decode b64, context 300": (64, 300, 1), "prefill 8 x 256": (8, 256, 256),
             "prefill 1 x 512 at context 1024": (1, 1024, 512),
             "100 decodes at context 1060, no shared blocks": (100, 1060, 1, 0),
             "100 decodes at context 1060, 1056 shared": (100, 1060, 1, 1056)}
    print("| case | " + " | ".join(f"{p} ms (GFLOP/s)" for p in paths) + " |")
    print("|---" * (1 + len(paths)) + "|")
    for name, shape in cases.items():
        fn, flops = case(*shape)
        cells = []
        for path in paths:
            kernels.set_paired_isa(path)
            ms = best_ms(fn)
            cells.append(f"{ms:.1f} ({flops / ms / 1e6:.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    kernels.set_paired_isa(kernels.paired_isa())


if __name__ == "__main__":
    main()
