"""The decoder's matmuls over 30 layers' distinct weights plus the output head, out of cache as
in a decode step, for builds of gemm.cpp at git revisions (WORK = the working tree), run
alternately: ms per pass of all 121 matmuls (median and min of 7), and whether the outputs
match the first build bit for bit.

    .venv/bin/python docs/results/issue17/gemm_stream.py avx2 1,16,64,128 HEAD WORK
"""
import sys, tempfile, time, statistics
from pathlib import Path
import torch
from kvloom.kernels import gemm
sys.path.insert(0, str(Path(__file__).parent))
from gemm_revisions import build  # noqa: E402 (a revision's gemm.cpp, built as kvloom builds it)
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
def weights(lib):
    torch.manual_seed(0)
    out = []
    for n, k in LAYER * 30 + [(49152, 576)]:
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); out.append((n, k, p))
    return out
def main():
    isa = gemm.ISAS.index(sys.argv[1]) + 1; rows = [int(r) for r in sys.argv[2].split(",")]; revs = sys.argv[3:]
    libs = []
    tmp = tempfile.mkdtemp()
    for r in revs:
        d = Path(tmp) / f"{len(libs)}_{r}"; d.mkdir(); libs.append(build(r, d))
    W = weights(libs[0])
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = [[torch.empty(m, n, dtype=torch.bfloat16) for n, k, p in W] for _ in libs]
        times = [[] for _ in libs]
        for rep in range(7):
            for i, lib in enumerate(libs):
                t = time.perf_counter()
                for (n, k, p), y in zip(W, ys[i]):
                    lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
                times[i].append(time.perf_counter() - t)
        same = all(all(torch.equal(a, b) for a, b in zip(ys[0], ys[i])) for i in range(1, len(libs)))
        print(f"M={m:4d} " + "  ".join(f"{r}: med {statistics.median(t)*1e3:7.2f} min {min(t)*1e3:7.2f}" for r, t in zip(revs, times)) + f"  bits {'same' if same else 'DIFF'}")
main()
