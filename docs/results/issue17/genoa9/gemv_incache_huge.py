"""gemv_incache.py with every packed copy on 2 MiB pages (kernels.huge_pages.empty_on_huge_pages, as
the model's weights are)."""
import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
from kvloom.kernels.huge_pages import empty_on_huge_pages
d = Path(tempfile.mkdtemp()); lib = build("WORK", d)
torch.manual_seed(0)
def packed(n, k, huge):
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    size = lib.kvloom_gemm_packed_elements(n, k)
    p = empty_on_huge_pages(size, torch.bfloat16) if huge else torch.empty(size, dtype=torch.bfloat16)
    lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); return p
flush = torch.ones(64 << 20, dtype=torch.float32)
for n, k in ((576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576)):
    copies = 4 if n == 49152 else 30
    res = {}
    for huge in (False, True):
        mats = [packed(n, k, huge) for _ in range(copies)]
        x = torch.randn(1, k).bfloat16(); y = torch.empty(1, n, dtype=torch.bfloat16)
        cold, warm = [], []
        for rep in range(9):
            flush.sum(); t = time.perf_counter()
            for p in mats: lib.kvloom_gemm_bf16(x.data_ptr(), p.data_ptr(), None, y.data_ptr(), 1, n, k, 3, 2)
            cold.append((time.perf_counter() - t) / copies)
            t = time.perf_counter()
            for _ in range(copies): lib.kvloom_gemm_bf16(x.data_ptr(), mats[0].data_ptr(), None, y.data_ptr(), 1, n, k, 3, 2)
            warm.append((time.perf_counter() - t) / copies)
        res[huge] = (statistics.median(cold), statistics.median(warm))
        del mats
    mb = n * k * 2 / 1e6
    print(f"{n}x{k} ({mb:.2f} MB): 4 KiB pages out of cache {res[False][0]*1e6:7.1f} us ({mb/res[False][0]/1e3:.1f} GB/s), "
          f"2 MiB pages {res[True][0]*1e6:7.1f} us ({mb/res[True][0]/1e3:.1f} GB/s); in cache {res[True][1]*1e6:6.1f} us", flush=True)
