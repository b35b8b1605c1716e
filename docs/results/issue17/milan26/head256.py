"""Gemma-shaped attention (4 query heads on 1 KV head of 256 dims, 26 layers: Gemma 3 1B),
bf16, blocks of 16 scattered over the pool: the token-major kernel (what head_dim 256 took
before it had the paired layout) against the paired one, alternating in one process; ms
for the 26 layers, median of ROUNDS. Cases: (seqs, context, query rows each).

    .venv/bin/python docs/results/issue17/milan26/head256.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvloom.attention.registry import make_backend
from kvloom.kernels import paged_attention as kernels

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 4, 1, 256, 16, 26
CASES = [(1, 300, 1), (16, 300, 1), (64, 300, 1), (4, 256, 256)]


def case(seqs: int, context: int, rows: int):
    blocks = -(-context // BLOCK)
    backend = make_backend("cpu_paged", torch.device("cpu"), HEADS, KV_HEADS, DIM)
    history = torch.randn(2, seqs * blocks * BLOCK, KV_HEADS, DIM).bfloat16()
    slots = torch.arange(seqs * blocks * BLOCK)
    paired = torch.zeros(2, seqs * blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
    backend.write_kv(paired, history[0], history[1], slots)  # the paired layout
    token_major = history.view(2, seqs * blocks, BLOCK, KV_HEADS, DIM).clone()
    tables = torch.randperm(seqs * blocks).int().view(seqs, blocks).contiguous()
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    query_lens = torch.full((seqs,), rows, dtype=torch.int32)
    query_start = torch.arange(seqs, dtype=torch.int32) * rows
    q = torch.randn(seqs * rows, HEADS, DIM).bfloat16()
    return paired, token_major, tables, seq_lens, query_start, query_lens, q


def timed(q, cache, tables, seq_lens, query_start, query_lens, paired: bool) -> float:
    start = time.perf_counter()
    for _ in range(LAYERS):
        kernels.paged_attention(q, cache, tables, seq_lens, query_start, query_lens, DIM ** -0.5, paired)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, paired path {kernels.paired_isa()}; ms for {LAYERS} layers, "
          f"median of {rounds}")
    for shape in CASES:
        paired, token_major, tables, seq_lens, query_start, query_lens, q = case(*shape)
        a = kernels.paged_attention(q, token_major, tables, seq_lens, query_start, query_lens, DIM ** -0.5, False)
        b = kernels.paged_attention(q, paired, tables, seq_lens, query_start, query_lens, DIM ** -0.5, True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for layout, cache in ((False, token_major), (True, paired)):
                times[layout].append(timed(q, cache, tables, seq_lens, query_start, query_lens, layout))
        old, new = statistics.median(times[False]), statistics.median(times[True])
        print(f"{shape}: token-major {old:.2f} ms, paired {new:.2f} ms ({old / new:.2f}x); "
              f"max |diff| {(a.float() - b.float()).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
