"""The 30 layers' matmuls (distinct weights, out of cache; no head) at M rows for gemm.cpp builds
from folders, each a copy of kvloom/csrc's gemm.cpp and headers with X_BYTES_PER_PASS changed,
alternating in one process (gemm_revisions.build takes a folder as a revision): median ms of 9
and whether the bits match the first.

    .venv/bin/python docs/results/issue17/genoa10/gemm_pass_sizes.py 2048,512,256 /tmp/pass256 /tmp/pass512
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvloom.kernels import gemm

sys.path.insert(0, str(Path(__file__).parents[1]))
from gemm_revisions import build  # noqa: E402 (a folder's gemm.cpp, built as kvloom builds it)

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    isa = gemm.ISAS.index("avx512_bf16") + 1
    folders = sys.argv[2:]
    libs = [build(folder, Path(tempfile.mkdtemp())) for folder in folders]
    torch.manual_seed(0)
    weights = []
    for n, k in LAYER * 30:
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        packed = torch.empty(libs[0].kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        libs[0].kvloom_gemm_pack(w.data_ptr(), n, k, packed.data_ptr())
        weights.append((n, k, packed))
    for m in (int(rows) for rows in sys.argv[1].split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = [[torch.empty(m, n, dtype=torch.bfloat16) for n, _, _ in weights] for _ in libs]
        times: list[list[float]] = [[] for _ in libs]
        for rep in range(9):
            for i in (range(len(libs)) if rep % 2 == 0 else reversed(range(len(libs)))):
                start = time.perf_counter()
                for (n, k, packed), y in zip(weights, ys[i], strict=True):
                    libs[i].kvloom_gemm_bf16(xs[k].data_ptr(), packed.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
                times[i].append(time.perf_counter() - start)
        same = all(torch.equal(a, b) for ys_i in ys[1:] for a, b in zip(ys[0], ys_i, strict=True))
        flops = sum(2 * m * n * k for n, k, _ in weights)
        medians = [statistics.median(t) for t in times]
        cells = "  ".join(f"{folder}: med {s * 1e3:.1f} ms ({flops / s / 1e9:.0f} GFLOP/s)"
                          for folder, s in zip(folders, medians, strict=True))
        print(f"M={m}: {cells} bits {'same' if same else 'DIFF'}", flush=True)


if __name__ == "__main__":
    main()
