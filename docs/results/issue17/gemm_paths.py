"""The default model's matmul shapes on every path this CPU runs: oneDNN (torch's
prepacked bf16 linear, AMX where the CPU has it) and kvloom's invariant GEMM on each of
its paths, GFLOP/s, best of 3 timed loops, 2 threads, the paths alternating per shape.

    .venv/bin/python docs/results/issue17/gemm_paths.py [M,M,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvloom.kernels import gemm
from kvloom.models.packed_linear import PackedLinear

sys.path.insert(0, str(Path(__file__).parents[1]))
from gemm_vs_onednn import SHAPES, best_ms  # noqa: E402 (the shapes and the timer of that comparison)


def main() -> None:
    rows = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 64, 200, 2048]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    paths = [isa for isa in gemm.supported_isas() if isa in ("avx512_bf16", "amx")]
    print(f"engine's path: {gemm.default_isa()}; GFLOP/s, oneDNN | " + " | ".join(paths))
    print("| shape (N x K) | M | oneDNN | " + " | ".join(paths) + " |")
    print("|---" * (3 + len(paths)) + "|")
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        onednn, packed = PackedLinear(weight, None), gemm.pack_weight(weight)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            reps = min(200, max(3, int(2e3 / (m * n * k / 1e6))))
            flops = 2 * m * n * k / 1e6
            cells = [flops / best_ms(lambda x=x: onednn(x), reps)]
            cells += [flops / best_ms(lambda x=x, isa=isa: gemm.gemm_bf16(x, packed, None, n, isa), reps)
                      for isa in paths]
            print(f"| {name} | {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
