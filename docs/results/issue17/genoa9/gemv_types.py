import sys, time, statistics, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "docs/results/issue17")
from gemm_revisions import build
from kvloom.kernels import gemm
isa = gemm.ISAS.index("avx512_bf16") + 1 if "avx512_bf16" in gemm.ISAS else 1
print("ISAS", gemm.ISAS, "using", isa)
d = Path(tempfile.mkdtemp()); lib = build("WORK", d)
TYPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30), "head": (49152, 576, 4)}
torch.manual_seed(0)
W = {}
for name, (n, k, copies) in TYPES.items():
    W[name] = []
    for _ in range(copies):
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        p = torch.empty(lib.kvloom_gemm_packed_elements(n, k), dtype=torch.bfloat16)
        lib.kvloom_gemm_pack(w.data_ptr(), n, k, p.data_ptr()); W[name].append((n, k, p))
flush = torch.empty(256 << 20, dtype=torch.uint8)
for m in (1, 8, 16):
    xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
    res = {name: [] for name in TYPES}
    for rep in range(7):
        for name in TYPES:
            flush.add_(1)
            ys = [torch.empty(m, n, dtype=torch.bfloat16) for n, k, p in W[name]]
            t = time.perf_counter()
            for (n, k, p), y in zip(W[name], ys):
                lib.kvloom_gemm_bf16(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), m, n, k, isa, 2)
            res[name].append(time.perf_counter() - t)
    line = []
    for name, (n, k, copies) in TYPES.items():
        t = statistics.median(res[name]); b = n * k * 2 * copies
        line.append(f"{name} {t/copies*1e6:7.1f} us {b/t/1e9:5.1f} GB/s")
    print(f"M={m:3d} " + " | ".join(line), flush=True)
