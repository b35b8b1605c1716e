import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
tmp = Path(tempfile.mkdtemp()); (tmp/"a").mkdir(); (tmp/"b").mkdir()
A, B = build("HEAD", tmp/"a"), build("WORK", tmp/"b")
torch.manual_seed(0)
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
W = []
for n, k in LAYER * 30 + [(49152, 576)]:
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    p = torch.empty(A.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
    A.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); W.append((n, k, p))
flush = torch.ones(64 << 20, dtype=torch.float32)
for m in [int(r) for r in sys.argv[1].split(",")]:
    xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
    ys = [[torch.empty(m, n, dtype=torch.bfloat16) for n, k, p in W] for _ in range(2)]
    ts = [[], []]
    for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
        for i, lib in ((0, A), (1, B)) if rep % 2 == 0 else ((1, B), (0, A)):
            flush.sum(); t = time.perf_counter()
            for (n, k, p), y in zip(W, ys[i]): lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, 3, 2)
            ts[i].append(time.perf_counter() - t)
    same = all(torch.equal(a, b) for a, b in zip(*ys))
    a, b = statistics.median(ts[0]), statistics.median(ts[1])
    print(f"M={m:3d} HEAD {a*1e3:6.2f} ms  WORK {b*1e3:6.2f} ms  ratio {a/b:.3f}  {'same' if same else 'DIFF'}", flush=True)
