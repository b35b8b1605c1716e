"""The decoder's matmuls at small M (30 layers' distinct weights and the head, out of cache as in a
decode step) on one thread against two, alternating in one process: ms a pass (median and min of
9), and whether the outputs match bit for bit (they must: a row's K order is the same).

    .venv/bin/python docs/results/issue17/genoa10/gemv_threads.py 1,2,4,8
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvloom.kernels import gemm

sys.path.insert(0, str(Path(__file__).parent.parent))
from gemm_revisions import build  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")]
    isa = gemm.ISAS.index("avx512_bf16") + 1
    lib = build("HEAD", Path(tempfile.mkdtemp()))
    torch.manual_seed(0)
    weights = []
    for n, k in LAYER * 30 + [(49152, 576)]:
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr())
        weights.append((n, k, p))
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        ys = {t: [torch.empty(m, n, dtype=torch.bfloat16) for n, _, _ in weights] for t in (1, 2)}
        times: dict[int, list[float]] = {1: [], 2: []}
        for rep in range(9):
            for threads in ((1, 2) if rep % 2 == 0 else (2, 1)):
                start = time.perf_counter()
                for (n, k, p), y in zip(weights, ys[threads], strict=True):
                    lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, isa, threads)
                times[threads].append(time.perf_counter() - start)
        same = all(torch.equal(a, b) for a, b in zip(ys[1], ys[2], strict=True))
        cells = "  ".join(f"{t} thread(s): med {statistics.median(v) * 1e3:6.2f} min {min(v) * 1e3:6.2f} ms"
                          for t, v in times.items())
        print(f"M={m:3d} {cells}  bits {'same' if same else 'DIFF'}", flush=True)


if __name__ == "__main__":
    main()
