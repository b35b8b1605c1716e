# One-off check (run from the repository root): kvloom_router_logits_bf16 built for AVX2 (x86-64-v3) and for
# no SIMD (x86-64), called through ctypes, against this CPU's AVX-512 build: AVX2 the same bits by construction
# (16 lanes of fmas in steps of 16, the lanes summed in _mm512_reduce_add_ps's order); the scalar build's sums
# are the compiler's to reorder under -ffast-math (its bits its own, within float32 rounding).
import ctypes, sys
from pathlib import Path
import torch
from kvloom import native
from kvloom.kernels import cpu_ops
src = Path("kvloom/csrc/cpu_ops.cpp")
flags_base = [f for f in native.flags_for("cpu_ops") if not f.startswith("-march")]
g = torch.Generator().manual_seed(0)
cases = [(t, e, n) for t, e, n in ((1, 64, 2048), (7, 9, 100), (33, 6, 15), (4, 256, 448), (3, 5, 17))]
for march in ("-march=x86-64-v3", "-march=x86-64"):
    so = Path(f"/tmp/s37/cpu_ops{march[7:]}.so")
    native.compile_library(src, so, flags_base + [march])
    f = ctypes.CDLL(str(so)).kvloom_router_logits_bf16
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    for t, e, n in cases:
        x = torch.randn(t, n, generator=g).bfloat16(); w = torch.randn(e, n, generator=g)
        out = torch.empty(t, e)
        f(x.data_ptr(), w.data_ptr(), out.data_ptr(), t, e, n)
        same = torch.equal(out.view(torch.int32), cpu_ops.router_logits(x, w).view(torch.int32))
        err = (out.double() - x.double() @ w.double().T).abs().max().item()
        print(march, (t, e, n), "same bits as this CPU's AVX-512 build:", same, f"max error vs float64 {err:.2e}")
