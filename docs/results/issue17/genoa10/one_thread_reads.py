"""One thread against two: a plain read (torch sum of 1 GiB) and decode attention (batch 64,
context 600, 30 layers of distinct caches; HUGE=1 puts them on 2 MiB pages as the engine's pool).

    HUGE=1 .venv/bin/python docs/results/issue17/genoa10/one_thread_reads.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, "docs/results/issue17")
import attention_paths as ap

from kvloom.kernels import paged_attention as kernels

kernels.load()
x = torch.ones(1 << 28)  # 1 GiB fp32
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    x.sum()
    t = min((lambda s: (x.sum(), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(5))
    print(f"sum 1 GiB, {threads} threads: {(1<<30)/t/1e9:.1f} GB/s", flush=True)
torch.manual_seed(0)
print("HUGE", os.environ.get("HUGE"))
fn, flops = ap.case(64, 600, 1)
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    ms = ap.best_ms(fn)
    kv = 64*600*30*768
    print(f"attention b64 ctx600, {threads} threads: {ms:.2f} ms {kv/ms/1e6:.1f} GB/s", flush=True)
