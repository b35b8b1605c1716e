"""silu_and_mul alone, in core-cycles per 16 outputs on two threads (notes.txt section 4).
    .venv/bin/python docs/results/issue17/genoa14/silu_time.py"""
import time, torch
from kvloom.kernels import cpu_ops
torch.manual_seed(0)
for rows in (2048, 256, 16):
    xs = [torch.randn(rows, 3072).to(torch.bfloat16) for _ in range(30 if rows == 2048 else 60)]
    for rep in range(3):
        t = time.perf_counter()
        for x in xs: cpu_ops.silu_and_mul(x)
        dt = (time.perf_counter() - t) / len(xs)
        n = rows * 1536
        print(f"rows {rows}: {dt*1e3:.3f} ms per call, {dt*2*3.67e9/(n/16):.1f} cycles per 16 (2 cores)")
    # hot: same tensor
    x = xs[0]
    for rep in range(2):
        t = time.perf_counter()
        for _ in range(30): cpu_ops.silu_and_mul(x)
        dt = (time.perf_counter() - t) / 30
        print(f"  hot rows {rows}: {dt*1e3:.3f} ms, {dt*2*3.67e9/(n/16):.1f} cyc/16")
