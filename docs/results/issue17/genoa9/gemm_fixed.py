import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
d = Path(tempfile.mkdtemp()); lib = build("WORK", d)
n, k = 32, 64
w = torch.randn(n, k).bfloat16(); p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr())
x = torch.randn(1, k).bfloat16(); y = torch.empty(1, n, dtype=torch.bfloat16)
for threads in (2, 1):
    ts = []
    for rep in range(7):
        t = time.perf_counter()
        for _ in range(10000): lib.kvloom_gemm_bf16(x.data_ptr(), p.data_ptr(), None, y.data_ptr(), 1, n, k, 3, threads)
        ts.append((time.perf_counter() - t) / 10000)
    print(f"tiny GEMM call (in cache), {threads} threads: {statistics.median(ts)*1e6:.2f} us")
