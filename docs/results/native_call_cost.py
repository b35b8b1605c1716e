"""The cost of one call of each native op at decode size (the default model, one token),
median of 7 timed loops, 1 thread, so that the kernel's work is small beside the call:
the layer ops through models/ops.py as the model calls them, and the GEMM through the
dispatcher (torch.ops.kvloom.gemm_bf16) and through its direct path (gemm.gemm_bf16,
what InvariantLinear calls). Run it on two checkouts to compare:

    PYTHONPATH=. .venv/bin/python docs/results/native_call_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvloom.kernels import gemm
from kvloom.models import ops


def microseconds(call: Callable[[], object], calls: int = 5000) -> float:
    for _ in range(200):
        call()
    loops = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


def main() -> None:
    torch.set_num_threads(1)
    bf16 = torch.bfloat16
    x, weight, residual = torch.randn(1, 576).to(bf16), torch.randn(576).to(bf16), torch.randn(1, 576).to(bf16)
    gate_up, qkv = torch.randn(1, 3072).to(bf16), torch.randn(1, 960).to(bf16)
    cos, sin = torch.randn(1, 64), torch.randn(1, 64)
    packed, isa = gemm.pack_weight(torch.randn(960, 576).to(bf16)), gemm.default_isa()
    cases = {
        "rms_norm + residual": lambda: ops.rms_norm(x, weight, 1e-5, residual),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "rotary_": lambda: ops.rotary_(qkv, 12, 64, cos, sin),
        "gemm 960 x 576, torch.ops": lambda: torch.ops.kvloom.gemm_bf16(x, packed, None, 960, isa),
        "gemm 960 x 576, gemm.gemm_bf16": lambda: gemm.gemm_bf16(x, packed, None, 960, isa),
    }
    for name, call in cases.items():
        print(f"{name:<32} {microseconds(call):6.2f} us")


if __name__ == "__main__":
    main()
