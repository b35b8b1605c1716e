"""The decoder matmuls of 30 layers + head out of cache (as gemm_stream.py), with the packed weights in
plain torch.empty tensors (4 KiB pages) vs in one buffer advised for 2 MiB pages, alternating, one build (HEAD).

    .venv/bin/python docs/results/issue17/gemm_huge_pages.py avx512_bf16 1,16,64,128
"""
import sys, tempfile, time, statistics
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from gemm_revisions import build
from kvloom.kernels import gemm
from kvloom.kernels.huge_pages import prefer_huge_pages
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]
def weights(lib, arena):
    torch.manual_seed(0)
    sizes = [lib.kvloom_gemm_packed_elements(n, k) for n, k in SHAPES]
    if arena:
        # each weight starts on a 4 KiB boundary
        offs, at = [], 0
        for s in sizes:
            offs.append(at); at += (s + 2047) // 2048 * 2048
        buf = torch.empty(at + (1 << 20), dtype=torch.bfloat16)
        ok = prefer_huge_pages(buf); print("huge", ok)
        buf.zero_()
    out = []
    for (n, k), s, i in zip(SHAPES, sizes, range(len(sizes))):
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        p = buf[offs[i]:offs[i] + s] if arena else torch.empty(s, dtype=torch.bfloat16)
        lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); out.append((n, k, p))
    return out
isa = gemm.ISAS.index(sys.argv[1]) + 1; rows = [int(r) for r in sys.argv[2].split(",")]
d = Path(tempfile.mkdtemp()); lib = build("HEAD", d)
Ws = [weights(lib, False), weights(lib, True)]
for m in rows:
    xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
    ys = [[torch.empty(m, n, dtype=torch.bfloat16) for n, k, p in W] for W in Ws]
    times = [[] for _ in Ws]
    for rep in range(9):
        for i, W in enumerate(Ws):
            t = time.perf_counter()
            for (n, k, p), y in zip(W, ys[i]):
                lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
            times[i].append(time.perf_counter() - t)
    same = all(torch.equal(a, b) for a, b in zip(ys[0], ys[1]))
    print(f"M={m:4d} " + "  ".join(f"{r}: med {statistics.median(t)*1e3:7.2f} min {min(t)*1e3:7.2f}" for r, t in zip(("4k", "huge"), times)) + f"  bits {'same' if same else 'DIFF'}", flush=True)
