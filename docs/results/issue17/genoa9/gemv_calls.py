import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
from kvloom.kernels import gemm
isa = 3
d = Path(tempfile.mkdtemp()); lib = build("WORK", d)
torch.manual_seed(0)
def packed(n, k):
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
    lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); return p
k = 576
for n, copies in ((576, 30), (3072, 30)):
    small = [packed(n, k) for _ in range(copies)]
    big = packed(n * copies, k)
    x = torch.randn(1, k).bfloat16(); y = torch.empty(1, n * copies, dtype=torch.bfloat16)
    flush = torch.ones(64 << 20, dtype=torch.float32)
    for threads in (2, 1):
        a, b = [], []
        for rep in range(9):
            flush.sum(); t = time.perf_counter()
            for p in small: lib.kvloom_gemm_bf16(x.data_ptr(), p.data_ptr(), None, y.data_ptr(), 1, n, k, isa, threads)
            a.append(time.perf_counter() - t)
            flush.sum(); t = time.perf_counter()
            lib.kvloom_gemm_bf16(x.data_ptr(), big.data_ptr(), None, y.data_ptr(), 1, n * copies, k, isa, threads)
            b.append(time.perf_counter() - t)
        by = n * k * 2 * copies
        print(f"n={n} x{copies} threads={threads}: {copies} calls {statistics.median(a)*1e3:.3f} ms ({by/statistics.median(a)/1e9:.1f} GB/s)  one call {statistics.median(b)*1e3:.3f} ms ({by/statistics.median(b)/1e9:.1f} GB/s)", flush=True)
