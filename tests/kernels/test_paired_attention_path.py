"""Which path paired-layout attention takes: one per process, the best this CPU has up
to the GEMM's path (AMX only where the GEMM's AMX check passed), and ``$KVLOOM_CPU_ISA``
caps both."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers_cpu import HAS_CPUINFO, cpu_flags

from kvloom.kernels import gemm
from kvloom.kernels import paged_attention as kernels

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="paged_attention.cpp does not build here"),
              pytest.mark.skipif(not HAS_CPUINFO, reason="reads Linux's CPU flags")]


def paired_isa_with(env_cap: str | None) -> str | None:
    code = "from kvloom.kernels import paged_attention as k\nk.load()\nprint(k.paired_isa())"
    env = None if env_cap is None else dict(os.environ, KVLOOM_CPU_ISA=env_cap)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parents[2], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    chosen = result.stdout.strip()
    return None if chosen == "None" else chosen


def best_vector_path() -> str | None:
    """What this CPU's flags allow short of AMX (the build is -march=native)."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else None


def capped(best: str | None, cap: str) -> str | None:
    """The path a cap leaves: the lower of the two (the names are ordered worst to best)."""
    return None if best is None else kernels.PAIRED_ISAS[min(kernels.PAIRED_ISAS.index(best),
                                                             kernels.PAIRED_ISAS.index(cap))]


def test_the_cap_keeps_amx_and_vdpbf16ps_out() -> None:
    best = best_vector_path()
    caps = ("avx512_bf16", "avx512", "avx2")
    with ThreadPoolExecutor(len(caps)) as pool:  # three processes' imports at once: the suite's time
        chosen = list(pool.map(paired_isa_with, caps))
    assert chosen == [best, capped(best, "avx512"), capped(best, "avx2")]


def test_amx_is_taken_only_where_the_gemm_takes_it() -> None:
    chosen = paired_isa_with(None)  # the child inherits any cap the suite runs under
    if gemm.default_isa() != "amx":
        ambient = os.environ.get(gemm.ISA_ENV)
        best = best_vector_path()
        assert chosen == (best if ambient is None else capped(best, ambient))
    else:  # an AMX machine: this build has the AMX path (built with -march=native)
        assert chosen == "amx"


def test_the_paired_layout_is_built_on_every_avx2_cpu() -> None:
    assert kernels.paired_layout(64, 16) == (best_vector_path() is not None)


def test_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"one of \('avx2', 'avx512', 'avx512_bf16', 'amx'\), got 'sse'"):
        kernels.set_paired_isa("sse")


def _attention_cases():
    """Groups of 1-8 query vectors per kv head, blocks of 16 and 32, fresh prefills, chunks,
    decodes and a walk over shared leading blocks, on random bytes read as the paired layout."""
    generator = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim in [(9, 3, 64), (8, 2, 32), (4, 4, 64), (8, 1, 128), (6, 6, 32), (3, 3, 128)]:
        for block in (16, 32):
            for seq_lens, query_lens, shared in [([37, 1, 200, 64, 129], [5, 1, 17, 64, 3], 0),
                                                 ([300] * 3, [1] * 3, 256)]:
                count = len(seq_lens)
                blocks, shared_blocks = -(-max(seq_lens) // block), shared // block
                total = shared_blocks + count * (blocks - shared_blocks)
                cache = torch.randn(2, total, block, kv_heads, dim, generator=generator).bfloat16()
                order = torch.randperm(total, generator=generator).int()
                tables = torch.empty(count, blocks, dtype=torch.int32)
                tables[:, :shared_blocks] = order[:shared_blocks]
                tables[:, shared_blocks:] = order[shared_blocks:].view(count, blocks - shared_blocks)
                starts = torch.tensor([0] + query_lens[:-1]).cumsum(0).int()
                q = torch.randn(sum(query_lens), heads, dim, generator=generator).bfloat16()
                yield (q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts,
                       torch.tensor(query_lens, dtype=torch.int32), dim ** -0.5, True)


@pytest.mark.skipif(best_vector_path() not in ("avx512", "avx512_bf16"),
                    reason="the AVX-512 FMA path needs an AVX-512 CPU")
def test_the_avx2_path_gives_the_avx512_fma_paths_bits() -> None:
    """paired_avx2.h promises each lane the AVX-512 FMA path's operations in their order, so
    an AVX2 machine and an AVX-512 one give a request the same tokens."""
    kernels.load()
    try:
        for args in _attention_cases():
            outputs = {}
            for path in ("avx2", "avx512"):
                assert kernels.set_paired_isa(path) == path
                outputs[path] = kernels.paged_attention(*args)
            assert torch.equal(outputs["avx2"].view(torch.int16), outputs["avx512"].view(torch.int16))
    finally:
        kernels.set_paired_isa(kernels.paired_isa())
