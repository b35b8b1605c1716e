"""Decode attention's cost per 16-key tile of one kv head on one thread with the KV in cache:
one sequence, one layer's cache called 200 times, contexts 128-4,096 (the slope between two
contexts is the per-tile cost; the intercept, the Python call).

    HUGE=1 .venv/bin/python docs/results/issue17/genoa10/decode_tile_cost.py
"""
import sys
import time

import torch

sys.path.insert(0, "docs/results/issue17")
import attention_paths as ap

from kvloom.kernels import paged_attention as kernels

kernels.load()
torch.manual_seed(0)
ap.LAYERS = 1
torch.set_num_threads(1)
for batch, ctx in [(1, 128), (1, 256), (1, 512), (1, 1024), (1, 2048), (1, 4096)]:
    fn, flops = ap.case(batch, ctx, 1)
    fn()
    best = 1e9
    for _ in range(9):
        s = time.perf_counter()
        for _ in range(200):
            fn()
        best = min(best, (time.perf_counter() - s) / 200)
    tiles = batch * 3 * ctx / 16
    print(f"b{batch} ctx{ctx} 1t: {best * 1e6:.1f} us a call, {best * 1e9 / tiles:.0f} ns a 16-key tile "
          f"({batch * ctx * 768 / 1024:.0f} KiB KV)", flush=True)
