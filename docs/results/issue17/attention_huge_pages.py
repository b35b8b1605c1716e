"""Decode attention over KV caches on 4 KiB pages vs on 2 MiB pages (madvise MADV_HUGEPAGE
before the first touch, as kvloom/runner/kv_pool.py does), the two sets of 30 layers' caches
in one process, run alternately (median of 9, ms per 30 layers).

    .venv/bin/python docs/results/issue17/attention_huge_pages.py
"""
import ctypes, time, statistics, torch
from kvloom.kernels import paged_attention as kernels
libc = ctypes.CDLL("libc.so.6"); MADV_HUGEPAGE = 14
HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
def alloc(n, huge):
    t = torch.empty(n + (4 << 20) // 2, dtype=torch.bfloat16)
    if huge:
        p = t.data_ptr(); a = (p + (2 << 20) - 1) & ~((2 << 20) - 1)
        assert libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t((n * 2) & ~((2 << 20) - 1)), MADV_HUGEPAGE) == 0
    return t[:n]
torch.manual_seed(0); torch.set_num_threads(2); kernels.load()
for batch, ctx in [(64, 300), (16, 1000)]:
    blocks = -(-ctx // BLOCK); total = batch * blocks
    n = 2 * total * BLOCK * KV_HEADS * DIM
    sets = {h: [alloc(n, h).normal_().view(2, total, BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)] for h in (False, True)}
    tables = torch.randperm(total).int().view(batch, blocks).contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32); ql = torch.ones(batch, dtype=torch.int32); qs = torch.arange(batch, dtype=torch.int32)
    q = torch.randn(batch, HEADS, DIM).bfloat16()
    times = {False: [], True: []}
    for rep in range(10):
        for h in (False, True):
            s = time.perf_counter()
            for c in sets[h]: kernels.paged_attention(q, c, tables, sl, qs, ql, 0.125, True)
            if rep: times[h].append(time.perf_counter() - s)
    print(f"b{batch}x{ctx}: 4K pages med {statistics.median(times[False])*1e3:.2f}  huge med {statistics.median(times[True])*1e3:.2f} ms")
print(open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split('\n')[0])
