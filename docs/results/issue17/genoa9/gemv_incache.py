import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
d = Path(tempfile.mkdtemp()); lib = build("WORK", d)
torch.manual_seed(0)
def packed(n, k):
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
    lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); return p
flush = torch.ones(64 << 20, dtype=torch.float32)
for n, k in ((576, 576), (960, 576), (3072, 576), (576, 1536)):
    mats = [packed(n, k) for _ in range(30)]
    x = torch.randn(1, k).bfloat16(); y = torch.empty(1, n, dtype=torch.bfloat16)
    cold, warm = [], []
    for rep in range(9):
        flush.sum(); t = time.perf_counter()
        for p in mats: lib.kvloom_gemm_bf16(x.data_ptr(), p.data_ptr(), None, y.data_ptr(), 1, n, k, 3, 2)
        cold.append((time.perf_counter() - t) / 30)
        p = mats[0]
        t = time.perf_counter()
        for _ in range(30): lib.kvloom_gemm_bf16(x.data_ptr(), p.data_ptr(), None, y.data_ptr(), 1, n, k, 3, 2)
        warm.append((time.perf_counter() - t) / 30)
    print(f"{n}x{k} ({n*k*2/1e6:.2f} MB): out of cache {statistics.median(cold)*1e6:6.1f} us, in cache {statistics.median(warm)*1e6:6.1f} us", flush=True)
