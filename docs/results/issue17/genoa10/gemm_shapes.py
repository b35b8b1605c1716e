"""kvloom's bf16 GEMM alone on the default model's four matrices (qkv, o, gate_up, down) at
M rows, 1 and 2 threads, in cache (best of 15), as a share of the vdpbf16ps peak (234 GFLOP/s a
core: vdpbf16ps_peak.cpp).

    .venv/bin/python docs/results/issue17/genoa10/gemm_shapes.py [M]
"""
import sys
import time

import torch

from kvloom.kernels import gemm

isa = gemm.default_isa()
M = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
for threads in (1, 2):
    torch.set_num_threads(threads)
    for name, n, k in [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]:
        x = torch.randn(M, k).bfloat16()
        w = gemm.pack_weight(torch.randn(n, k).bfloat16())
        gemm.gemm_bf16(x, w, None, n, isa)
        best = 1e9
        for _ in range(15):
            start = time.perf_counter()
            gemm.gemm_bf16(x, w, None, n, isa)
            best = min(best, time.perf_counter() - start)
        rate = 2 * M * k * n / best / 1e9
        print(f"{threads}t M={M} {name:8s} {rate:6.1f} GFLOP/s ({100 * rate / (234 * threads):.0f}% of peak) "
              f"{best * 1e3:.2f} ms", flush=True)
