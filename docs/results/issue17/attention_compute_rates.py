"""Paired-layout attention's compute rate where the KV stays in cache: prompt-shaped
calls (the default model's 9 query and 3 kv heads, blocks of 16), one layer's pool
reused 30 times, on this CPU's default path. GFLOP/s count the causal work only (each
query row against the keys it sees, 4 FLOPs per key and dim), unlike
attention_paths.py, which counts whole contexts. Head dims 64 and 128: a softmax that
cost much would show as a faster rate at 128 (twice the fmas per softmax).

    .venv/bin/python docs/results/issue17/attention_compute_rates.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kvloom.kernels import paged_attention as kernels

sys.path.insert(0, str(Path(__file__).parent))
from attention_paths import best_ms  # noqa: E402 (best of 5, in ms)

BLOCK, REPEATS = 16, 30


def case(dim: int, batch: int, context: int, query_len: int, heads: int = 9,
         kv_heads: int = 3) -> tuple[Callable[[], object], float]:
    blocks = -(-context // BLOCK)
    cache = torch.empty((2, batch * blocks, BLOCK, kv_heads, dim), dtype=torch.bfloat16).normal_()
    tables = torch.randperm(batch * blocks).int().view(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query_lens = torch.full((batch,), query_len, dtype=torch.int32)
    query_start = torch.arange(batch, dtype=torch.int32) * query_len
    q = torch.randn(batch * query_len, heads, dim).bfloat16()
    seen = sum(context - query_len + row + 1 for row in range(query_len))
    flops = REPEATS * batch * heads * seen * dim * 4
    return (lambda: [kernels.paged_attention(q, cache, tables, seq_lens, query_start, query_lens, 0.125, True)
                     for _ in range(REPEATS)]), flops


def main() -> None:
    torch.manual_seed(0)
    kernels.load()
    print(f"path {kernels.paired_isa()}, {REPEATS} calls a case, best of 5")
    print("| case | head dim 64: ms (GFLOP/s) | head dim 128: ms (GFLOP/s) |")
    print("|---|---|---|")
    for name, shape in [("prefill 8 x 256", (8, 256, 256)), ("prefill 1 x 512 at context 1,024", (1, 1024, 512)),
                        ("51 x 40 at context 1,032 (the prefix run's)", (51, 1032, 40))]:
        cells = []
        for dim in (64, 128):
            fn, flops = case(dim, *shape)
            ms = best_ms(fn)
            cells.append(f"{ms:.1f} ({flops / ms / 1e6:.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
