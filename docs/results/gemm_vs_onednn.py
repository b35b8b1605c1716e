"""One bf16 matmul of the default model's shapes: oneDNN (prepacked) vs kvloom's
batch-invariant GEMM, GFLOP/s, best of 3 timed loops each, 2 threads, alternating.

    .venv/bin/python docs/results/gemm_vs_onednn.py > docs/results/gemm_vs_onednn.txt
"""

from __future__ import annotations

import time

import torch

from kvloom.kernels import gemm
from kvloom.models.packed_linear import InvariantLinear, PackedLinear

SHAPES = {"qkv 960 x 576": (960, 576), "o 576 x 576": (576, 576), "gate/up 3072 x 576": (3072, 576),
          "down 576 x 1536": (576, 1536), "lm_head 49152 x 576": (49152, 576)}
ROWS = (1, 16, 64, 200, 2048)


def best_ms(fn, reps: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print(f"path: {gemm.default_isa()}; GFLOP/s oneDNN vs invariant")
    print("| shape (N x K) | " + " | ".join(f"M = {m}" for m in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        onednn, ours = PackedLinear(weight, None), InvariantLinear(weight, None)
        cells = []
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            reps = min(200, max(3, int(2e3 / (m * n * k / 1e6))))
            flops = 2 * m * n * k / 1e6
            theirs_ms = best_ms(lambda layer=onednn, x=x: layer(x), reps)
            ours_ms = best_ms(lambda layer=ours, x=x: layer(x), reps)
            cells.append(f"{flops / theirs_ms:.0f} vs {flops / ours_ms:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
