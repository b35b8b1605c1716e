# One-off check (run from the repository root): the latent kernel built for AVX2 (x86-64-v3) and for no SIMD
# (x86-64), called through ctypes, against tests/attention/test_latent_attention.py's float64 oracle.
import ctypes, subprocess, sys, torch
sys.path.insert(0, "tests/attention")
from kvloom import native
from pathlib import Path
src = Path("kvloom/csrc/latent_attention.cpp")
flags_base = [f for f in native.flags_for("latent_attention") if not f.startswith("-march")]
import test_latent_attention as T
for march in ("-march=x86-64-v3", "-march=x86-64"):
    so = Path(f"/tmp/s36/la{march[7:]}.so")
    native.compile_library(src, so, flags_base + [march])
    lib = ctypes.CDLL(str(so))
    f = lib.kvloom_latent_attention
    f.restype = ctypes.c_int
    for dtype in (torch.float32, torch.bfloat16):
        for dim, vdim, bs in ((288, 256, 16), (40, 32, 8), (24, 5, 32)):
            pool = T.Pool(T.SPANS, dim, dtype, bs)
            q = pool.q.contiguous(); out = torch.empty(q.shape[0], 3, vdim, dtype=dtype)
            I = lambda xs: torch.tensor(list(xs), dtype=torch.int32)
            sl, st, ql = I(s for _, s in pool.spans), I(pool.starts), I(q_ for q_, _ in pool.spans)
            args = [q.data_ptr(), out.data_ptr(), pool.cache.data_ptr(), pool.tables.data_ptr(), pool.tables.shape[1],
                    sl.data_ptr(), st.data_ptr(), ql.data_ptr(), len(pool.spans), 3, dim, vdim, bs]
            f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            rc = f(*args, 0.1, 0 if dtype == torch.float32 else 1, 0, 2)
            err = (out.double() - pool.oracle(vdim, 0.1)).abs().max().item()
            print(march, dtype, dim, vdim, bs, "rc", rc, "max err", f"{err:.2e}")
