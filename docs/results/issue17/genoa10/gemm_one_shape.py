"""Each of the layer's four matrices at 2,048 rows called 30 times in a row (one packed copy, in
cache), 7 repeats: the median and the best GFLOP/s of a call.

    .venv/bin/python docs/results/issue17/genoa10/gemm_one_shape.py
"""
import statistics
import time

import torch

from kvloom.kernels import gemm

isa = gemm.default_isa()
torch.manual_seed(0)
m = 2048
for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
    p = gemm.pack_weight((torch.randn(n, k) / k ** 0.5).bfloat16())
    x = torch.randn(m, k).bfloat16()
    ts = []
    for _rep in range(7):
        s = time.perf_counter()
        for _ in range(30):
            gemm.gemm_bf16(x, p, None, n, isa)
        ts.append((time.perf_counter() - s) / 30)
    f = 2 * m * n * k
    print(f"{n}x{k}: median {f/statistics.median(ts)/1e9:.0f} GFLOP/s, best {f/min(ts)/1e9:.0f}", flush=True)
