"""Paired-layout attention over sequences of unequal length, as in a real step (decode: a context per
sequence; prefill: each sequence's whole prompt as its query), 30 layers out of cache, for builds of
paged_attention.cpp at git revisions (WORK = the working tree), alternating; uses attention_stream.py's build.

    .venv/bin/python docs/results/issue17/attention_uneven.py HEAD WORK HEAD WORK
"""
import os, sys, statistics, time, tempfile, random
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
import attention_stream as A  # noqa: E402
from kvloom.kernels.huge_pages import prefer_huge_pages  # noqa: E402
LAYERS = int(os.environ.get("LAYERS", "30"))
def case(ctx, qlens):
    B = A.BLOCK
    blocks = [-(-c // B) for c in ctx]
    total = sum(blocks); mb = max(blocks)
    caches = []
    for _ in range(LAYERS):
        c = torch.empty(2, total, B * A.KV_HEADS * A.DIM, dtype=torch.bfloat16); prefer_huge_pages(c); caches.append(c.normal_())
    perm = torch.randperm(total).int()
    tables = torch.zeros(len(ctx), mb, dtype=torch.int32); at = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[at:at + b]; at += b
    seq_lens = torch.tensor(ctx, dtype=torch.int32); query_lens = torch.tensor(qlens, dtype=torch.int32)
    query_start = torch.cumsum(torch.tensor([0] + qlens[:-1]), 0).int()
    q = torch.randn(sum(qlens), A.HEADS, A.DIM).bfloat16()
    return caches, tables.contiguous(), seq_lens, query_start, query_lens, q
def run(lib, caches, tables, seq_lens, query_start, query_lens, q, outs):
    for cache, out in zip(caches, outs):
        lib.kvloom_paged_attention(q.data_ptr(), out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), query_start.data_ptr(), query_lens.data_ptr(), len(seq_lens), A.HEADS, A.KV_HEADS, A.DIM, A.BLOCK, 0.125, 2, 2)
random.seed(1); torch.manual_seed(0)
cases = {
  "decode 8 mixed (one 2000 last)": ([300, 250, 400, 350, 200, 300, 280, 2000], [1] * 8),
  "decode 4 [300,400,600,1500]": ([300, 400, 600, 1500], [1] * 4),
  "decode 5 [200 x 4, 2000]": ([200, 2000, 200, 200, 200], [1] * 5),
  "decode 12 [150-400 x 11, 1800]": ([1800] + [random.randint(150, 400) for _ in range(11)], [1] * 12),
  "decode 24 random 50-1500": ([random.randint(50, 1500) for _ in range(24)], [1] * 24),
  "decode 64 sharegpt-like": ([random.randint(100, 900) for _ in range(64)], [1] * 64),
  "prefill 2048 chunk (1015 last)": ([243, 180, 300, 310, 1015], [243, 180, 300, 310, 1015]),
}
revs = sys.argv[1:]
tmp = Path(tempfile.mkdtemp()); libs = []
for i, r in enumerate(revs):
    (tmp / str(i)).mkdir(); libs.append(A.build(r, tmp / str(i)))
for name, (ctx, ql) in cases.items():
    data = case(ctx, ql)
    outs = [[torch.empty(sum(ql), A.HEADS, A.DIM, dtype=torch.bfloat16) for _ in range(LAYERS)] for _ in libs]
    times = [[] for _ in libs]
    for rep in range(12):
        for i, lib in enumerate(libs):
            t = time.perf_counter(); run(lib, *data, outs[i]); 
            if rep: times[i].append(time.perf_counter() - t)
    same = all(all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])
    print(f"{name:34s} " + "  ".join(f"{r}: med {statistics.median(t)*1e3:6.2f} min {min(t)*1e3:6.2f}" for r, t in zip(revs, times)) + ("  bits same" if same else "  BITS DIFFER"), flush=True)
