"""What the MXFP4 kernel (kvloom/kernels/mxfp4.py) costs at GPT-OSS-20b's expert shapes:
gate_up (n = 5760, k = 2880) and down (n = 2880, k = 2880), bf16 x of 1, 4 and 16 rows,
against the same products through dequantize_mxfp4 then F.linear in bf16 (per call, and
with W dequantized once beforehand: what keeping the experts in bf16 would run, at 3.8x
the memory).

Each call reads one expert of a pool of POOL distinct ones, so the weight comes from
memory as in a decode step (an expert's 8.8 / 4.4 MB would otherwise sit in the 32 MB L3);
"in cache" repeats the call on the expert just read. Median of ROUNDS calls each; GB/s is
the MXFP4 bytes (blocks + scales) over the median time.

    .venv/bin/python docs/results/issue17/genoa32/mxfp4_gemm.py [ROUNDS] [POOL]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom.kernels import mxfp4

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
POOL = int(sys.argv[2]) if len(sys.argv) > 2 else 12
SHAPES = [("gate_up", 5760, 2880), ("down", 2880, 2880)]
ROWS = (1, 4, 16)


def cpu_line() -> str:
    fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if ":" in line)
    model = f"{fields.get('Model name', '?').strip()} model {fields.get('Model', '?').strip()}"
    flags = fields.get("Flags", "").split()
    return (f"{model} (family {fields.get('CPU family', '?').strip()}, {torch.get_num_threads()} threads, "
            f"{'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'}, "
            f"{'AMX' if 'amx_tile' in flags else 'no AMX'})")


def median_ms(call: Callable[[int], object], rounds: int) -> float:
    times = []
    for index in range(rounds):
        start = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(cpu_line())
    print(f"kvloom mxfp4_linear on {mxfp4.default_isa()}; median of {ROUNDS} calls; from memory: "
          f"each call on the next of {POOL} experts; in cache: the same expert again")
    print(f"{'matmul':8} {'rows':>4} | {'mxfp4 ms':>8} {'GB/s':>5} {'cached ms':>9} {'GB/s':>5} | "
          f"{'deq+linear ms':>13} | {'bf16 linear ms':>14}")
    generator = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        pool = [(torch.randint(0, 256, (n, k // 32, 16), generator=generator, dtype=torch.uint8),
                 torch.randint(117, 131, (n, k // 32), generator=generator, dtype=torch.uint8))
                for _ in range(POOL)]
        dense = [mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16) for blocks, scales in pool]
        weight_bytes = pool[0][0].numel() + pool[0][1].numel()
        for m in ROWS:
            x = torch.randn(m, k, generator=generator).bfloat16()
            for blocks, scales in pool:  # warm up: the library, the threads, the pages
                mxfp4.mxfp4_linear(x, blocks, scales)
            cold = median_ms(lambda i: mxfp4.mxfp4_linear(x, *pool[i % POOL]), ROUNDS)
            hot = median_ms(lambda i: mxfp4.mxfp4_linear(x, *pool[0]), ROUNDS)
            dequantized = median_ms(
                lambda i: F.linear(x, mxfp4.dequantize_mxfp4(*pool[i % POOL], torch.bfloat16)), max(8, ROUNDS // 8))
            linear = median_ms(lambda i: F.linear(x, dense[i % POOL]), ROUNDS)
            print(f"{name:8} {m:4} | {cold:8.3f} {weight_bytes / cold / 1e6:5.1f} {hot:9.3f} "
                  f"{weight_bytes / hot / 1e6:5.1f} | {dequantized:13.2f} | {linear:14.3f}")


if __name__ == "__main__":
    main()
