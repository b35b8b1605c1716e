# Variants of latent_attention.cpp (copies under /tmp/s36: NAME.cpp, simd.h beside them) in one process,
# alternating, 30 layers' pools so that the KV comes from memory: `python latent_prefetch_ab.py BATCH CONTEXT NAME...`.
# $AB_DIR: another directory of variants (the thirty-seventh session's: /tmp/s37/ab, simd.h copied beside them).
import ctypes, os, sys, time, torch
from pathlib import Path
from kvloom import native
DIR = os.environ.get("AB_DIR", "/tmp/s36")
variants = {name: Path(f"{DIR}/{name}.cpp") for name in sys.argv[3:]}
flags = native.flags_for("latent_attention") + ["-I", DIR if "AB_DIR" in os.environ else "/work/main/kvloom/csrc"]
libs = {}
for name, src in variants.items():
    so = Path(f"{DIR}/{name}.so"); native.compile_library(src, so, flags)
    f = ctypes.CDLL(str(so)).kvloom_latent_attention
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    libs[name] = f
torch.manual_seed(0)
heads, dim, vdim, layers, bs = 9, 288, 256, 30, 16
batch, ctx = int(sys.argv[1]), int(sys.argv[2])
nb = batch * (-(-ctx // bs)) + 1
caches = [torch.randn(1, nb, bs, 1, dim).bfloat16() for _ in range(layers)]
perm = torch.randperm(nb).tolist()
bt = torch.zeros(batch, -(-ctx // bs), dtype=torch.int32)
for i in range(batch):
    for b in range(bt.shape[1]): bt[i, b] = perm.pop()
I = lambda a: torch.tensor(a, dtype=torch.int32)
q = torch.randn(batch, heads, dim).bfloat16(); out = torch.empty(batch, heads, vdim).bfloat16()
sl, st, ql = I([ctx] * batch), I(list(range(batch))), I([1] * batch)
def step(f):
    for c in caches:
        f(q.data_ptr(), out.data_ptr(), c.data_ptr(), bt.data_ptr(), bt.shape[1], sl.data_ptr(), st.data_ptr(),
          ql.data_ptr(), batch, heads, dim, vdim, bs, 0.1, 1, 1, 2)
times = {name: [] for name in libs}
for r in range(12):
    for name, f in libs.items():
        t = time.perf_counter(); step(f); times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    ts.sort(); print(f"b{batch}x{ctx} {name:10s} min {ts[0]*1e3:7.2f} med {ts[6]*1e3:7.2f} ms (30 layers)")
