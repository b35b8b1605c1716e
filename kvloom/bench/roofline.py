"""`kvloom bench roofline`: this machine's limits, and what they mean for a decode step.

Measures matmul throughput (bf16 and fp32 through torch; large and decode-shaped; and
kvloom's own bf16 GEMM on the path the engine takes) and memory bandwidth, then derives
the lower bound on one decode step of a model: every weight read once plus every
running sequence's KV read once, or the FLOPs at the best measured bf16 rate (torch's or
kvloom's: on a CPU without AVX512-BF16, torch's bf16 matmul is oneDNN's slow reference
path, and a bound from it would be no bound), whichever is larger. With ``--steps`` it
also times this engine's own decode steps at those batch sizes (``bench steps``'s
``time_decode``, bf16, the prompts sized so that the timed steps read the bound's context
on average) and prints each against its bound.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvloom.config import ModelConfig

if TYPE_CHECKING:  # bench/steps.py imports the engine, which the bound alone does not need
    from kvloom.bench.steps import StepTiming


def _best_time(fn, repeats: int = 5, inner: int = 3) -> float:
    fn()  # warm up (oneDNN picks and caches its kernel on the first call)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype)
    seconds = _best_time(lambda: torch.nn.functional.linear(a, b))
    return 2 * m * k * n / seconds / 1e9


def kvloom_gemm_gflops(m: int, k: int, n: int) -> float | None:
    """kvloom's batch-invariant bf16 GEMM on the engine's path (None where it does not
    build or run here)."""
    from kvloom.kernels import gemm

    isa = gemm.default_isa()
    if isa is None:
        return None
    x = torch.randn(m, k).bfloat16()
    packed = gemm.pack_weight(torch.randn(n, k).bfloat16())
    seconds = _best_time(lambda: gemm.gemm_bf16(x, packed, None, n, isa))
    return 2 * m * k * n / seconds / 1e9


def memory_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Read + write bandwidth of a large copy (counts both directions)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats=3, inner=2)
    return 2 * num_bytes / seconds / 1e9


@dataclass(frozen=True)
class DecodeBound:
    weight_bytes: int
    kv_bytes: int
    flops: float
    memory_seconds: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)


def decode_step_bound(model: ModelConfig, num_params: int, batch: int, context: int,
                      dtype: torch.dtype, bandwidth_gbs: float, gflops: float) -> DecodeBound:
    element = torch.empty((), dtype=dtype).element_size()
    weight_bytes = num_params * element
    kv_bytes = batch * context * model.num_layers * 2 * model.num_kv_heads * model.head_dim * element
    attention_flops = batch * context * model.num_layers * model.num_heads * model.head_dim * 4
    flops = 2 * num_params * batch + attention_flops
    return DecodeBound(weight_bytes, kv_bytes, flops,
                       (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9), flops / (gflops * 1e9))


def run_roofline(model: ModelConfig, num_params: int, batches: list[int], context: int,
                 decode_steps: Mapping[int, StepTiming] | None = None) -> str:
    """The rates, the bandwidth and the bound per batch size; with ``decode_steps`` (timed
    steps by batch size, as from :func:`time_engine_steps`), each against its bound."""
    lines = ["matmul throughput (GFLOP/s, best of 5):"]
    rates: dict[tuple[str, int], float] = {}
    h, i = model.hidden_size, model.intermediate_size
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        big = matmul_gflops(2048, 2048, 2048, dtype)
        lines.append(f"  {label} 2048x2048x2048: {big:8.1f}")
        for m in batches:
            rate = matmul_gflops(m, h, 2 * i, dtype)
            rates[(label, m)] = rate
            lines.append(f"  {label} decode-shaped {m}x{h}x{2 * i}: {rate:8.1f}")
    for m in batches:
        ours = kvloom_gemm_gflops(m, h, 2 * i)
        if ours is not None:
            lines.append(f"  kvloom GEMM bf16 decode-shaped {m}x{h}x{2 * i}: {ours:8.1f}")
            rates[("bf16", m)] = max(rates[("bf16", m)], ours)
    bandwidth = memory_bandwidth_gbs()
    lines.append(f"memory bandwidth (copy, read+write): {bandwidth:.1f} GB/s")
    lines.append(f"decode step lower bound (bf16 at the better of torch's and kvloom's rate, context {context}):")
    lines.append(f"  {'batch':>5} {'weights MB':>10} {'KV MB':>8} {'GFLOP':>7} {'mem ms':>7} "
                 f"{'compute ms':>10} {'bound ms':>9} {'tok/s':>8}")
    bounds: dict[int, DecodeBound] = {}
    for m in batches:
        bound = decode_step_bound(model, num_params, m, context, torch.bfloat16, bandwidth,
                                  rates[("bf16", m)])
        lines.append(f"  {m:>5} {bound.weight_bytes / 1e6:>10.1f} {bound.kv_bytes / 1e6:>8.1f} "
                     f"{bound.flops / 1e9:>7.2f} {bound.memory_seconds * 1e3:>7.2f} "
                     f"{bound.compute_seconds * 1e3:>10.2f} {bound.seconds * 1e3:>9.2f} "
                     f"{m / bound.seconds:>8.0f}")
        bounds[m] = bound
    if decode_steps:
        lines.append("this engine's decode steps (LLMEngine.step(), median) against the bound:")
        lines.append(f"  {'batch':>5} {'steps':>5} {'mean KV':>8} {'step ms':>8} {'bound ms':>9} {'step/bound':>10}")
        for m, timing in decode_steps.items():
            step = statistics.median(timing.milliseconds)
            kv = statistics.fmean(timing.kv_tokens) if timing.kv_tokens else float("nan")
            lines.append(f"  {m:>5} {len(timing.milliseconds):>5} {kv:>8.1f} {step:>8.2f} "
                         f"{bounds[m].seconds * 1e3:>9.2f} {step / (bounds[m].seconds * 1e3):>9.2f}x")
    return "\n".join(lines)


def time_engine_steps(model: str, batches: list[int], context: int, steps: int) -> dict[int, StepTiming]:
    """``steps`` decode steps of this engine per batch size, bf16 (the bound's dtype),
    their prompts sized so that the timed steps read ``context`` keys on average."""
    from kvloom.bench.steps import time_decode
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    tokens = max(batches) * (context + steps + 16)
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", enable_prefix_caching=False,
                                                max_num_seqs=max(batches + [256]), num_blocks=tokens // 16 + 64))
    try:
        time_decode(engine, batches[0], context, min(steps, 3), seed=99, centred=True)  # warm-up
        return {batch: time_decode(engine, batch, context, steps, seed=batch, centred=True) for batch in batches}
    finally:
        engine.shutdown()
