"""A/B of one mixture-of-experts layer's forward (models/moe.py SparseMoE, bf16, packed for
the invariant GEMM): the grouped GEMM and the native combine (this session) against each
expert's own two calls (grouped=None), alternating in one process, median of many calls.
The weights are 30 layers' worth, cycled, so that each call reads its experts from memory
as a decode step does. Shapes: bench families' `moe` (8 experts of 384, top 2) and
`moe_fine` (64 of 96, top 8), hidden 576."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvloom.model_families import MoEConfig
from kvloom.models.moe import SparseMoE

torch.manual_seed(0)
SHAPES = {"moe": (8, 2, 384), "moe_fine": (64, 8, 96)}
LAYERS = 30


def layers(experts: int, top_k: int, inter: int) -> list[SparseMoE]:
    built = []
    for _ in range(LAYERS):
        moe = SparseMoE(576, MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                                       sparse_layers=(0,)))
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.05)
        moe = moe.to(torch.bfloat16)
        moe.pack("invariant")
        built.append(moe)
    return built


def timed(stack: list[SparseMoE], x: torch.Tensor, grouped: bool) -> float:
    saved = [m.grouped for m in stack]
    if not grouped:
        for m in stack:
            m.grouped = None
    start = time.perf_counter()
    with torch.no_grad():
        for m in stack:
            m(x)
    elapsed = time.perf_counter() - start
    for m, g in zip(stack, saved):
        m.grouped = g
    return elapsed * 1e3


for name in sys.argv[1:] or list(SHAPES):
    stack = layers(*SHAPES[name])
    for tokens in (1, 16, 64, 512):
        x = torch.randn(tokens, 576).bfloat16()
        a, b = [], []
        for _ in range(7 if tokens == 512 else 15):
            b.append(timed(stack, x, False))
            a.append(timed(stack, x, True))
        print(f"{name:9s} tokens {tokens:4d}: 30 layers' experts, per-expert calls {statistics.median(b):7.2f} ms, "
              f"grouped {statistics.median(a):7.2f} ms (min {min(b):.2f} / {min(a):.2f})", flush=True)
