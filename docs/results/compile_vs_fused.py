"""torch.compile (inductor) vs kvloom's eager path on the part of a decoder layer it could own:
residual add + RMSNorm, gate/up matmul, silu * up, down matmul (bf16, SmolLM2-135M shapes).
Attention and our fused ops are ctypes calls that dynamo cannot trace, so a whole-model
compile would break the graph at each of them. Run: .venv/bin/python docs/results/compile_vs_fused.py
"""

import time

import torch
import torch.nn.functional as F

from kvloom.models import ops
from kvloom.models.packed_linear import PackedLinear

HIDDEN, INTERMEDIATE, EPS = 576, 1536, 1e-5
DTYPE = torch.bfloat16
torch.manual_seed(0)
norm_weight = torch.randn(HIDDEN, dtype=DTYPE)
gate_up_weight = torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=DTYPE) * 0.02
down_weight = torch.randn(HIDDEN, INTERMEDIATE, dtype=DTYPE) * 0.02
gate_up_packed, down_packed = PackedLinear(gate_up_weight, None), PackedLinear(down_weight, None)


def eager_fused(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What kvloom runs: fused C++ ops and oneDNN-prepacked weights."""
    normed = ops.rms_norm(x, norm_weight, EPS, residual)
    return down_packed(ops.silu_and_mul(gate_up_packed(normed)))


def pytorch_ops(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The same arithmetic as plain PyTorch ops (what torch.compile gets to fuse)."""
    residual.add_(x)
    r = residual.float()
    normed = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS)).to(DTYPE) * norm_weight
    gate, up = F.linear(normed, gate_up_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight)


compiled = torch.compile(pytorch_ops, dynamic=False)
variants = {"eager fused C++ + prepacked": eager_fused, "eager PyTorch ops": pytorch_ops,
            "torch.compile(PyTorch ops)": compiled}
for tokens in (16, 64, 256):
    x, residual = torch.randn(tokens, HIDDEN, dtype=DTYPE), torch.randn(tokens, HIDDEN, dtype=DTYPE)
    for name, function in variants.items():
        start = time.perf_counter()
        function(x, residual.clone())
        first = time.perf_counter() - start
        for _ in range(5):
            function(x, residual.clone())
        calls = 200 if tokens < 256 else 50
        start = time.perf_counter()
        for _ in range(calls):
            function(x, residual.clone())
        per_call = (time.perf_counter() - start) / calls
        print(f"M={tokens:4d} {name:30s} {per_call * 1e6:8.1f} us/layer (first call {first:.1f} s)")
