"""torch.compile (inductor) vs kvloom's eager path on the part of a decoder layer it could own:
residual add + RMSNorm, gate/up matmul, silu * up, down matmul (bf16, SmolLM2-135M shapes).
Attention and our fused ops are ctypes calls that dynamo cannot trace, so a whole-model
compile would break the graph at each of them. Run: .venv/bin/python docs/results/compile_vs_fused.py"""
import time

import torch
import torch.nn.functional as F

from kvloom.models import ops
from kvloom.models.packed_linear import PackedLinear

torch.manual_seed(0)
H, I = 576, 1536
dt = torch.bfloat16
w_norm = torch.randn(H, dtype=dt)
w_gu = torch.randn(2 * I, H, dtype=dt) * 0.02
w_down = torch.randn(H, I, dtype=dt) * 0.02
gu_lin = torch.nn.Linear(H, 2 * I, bias=False, dtype=dt); gu_lin.weight.data = w_gu
dn_lin = torch.nn.Linear(I, H, bias=False, dtype=dt); dn_lin.weight.data = w_down
gu_packed, dn_packed = PackedLinear(w_gu, None), PackedLinear(w_down, None)

def eager_ours(x, residual):
    h = ops.rms_norm(x, w_norm, 1e-5, residual)
    return dn_packed(ops.silu_and_mul(gu_packed(h)))

def reference(x, residual):
    residual.add_(x)
    h = (residual.float() * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * w_norm
    gu = F.linear(h, w_gu)
    g, u = gu.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w_down)

compiled = torch.compile(reference, dynamic=False)
for M in (16, 64, 256):
    x = torch.randn(M, H, dtype=dt); r = torch.randn(M, H, dtype=dt)
    for name, f in (("eager fused C++ + prepacked", eager_ours), ("eager PyTorch ops", reference), ("torch.compile(PyTorch ops)", compiled)):
        t0 = time.perf_counter(); f(x, r.clone()); first = time.perf_counter() - t0
        for _ in range(5): f(x, r.clone())
        n = 200 if M < 256 else 50
        t = time.perf_counter()
        for _ in range(n): f(x, r.clone())
        print(f"M={M:4d} {name:30s} {(time.perf_counter()-t)/n*1e6:8.1f} us/layer (first call {first:.1f} s)")
