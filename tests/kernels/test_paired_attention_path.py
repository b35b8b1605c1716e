"""Which path paired-layout attention takes: one per process, the best this CPU has up
to the GEMM's path (AMX only where the GEMM's AMX check passed), and ``$KVLOOM_CPU_ISA``
caps both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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
    assert paired_isa_with("avx512_bf16") == best
    assert paired_isa_with("avx512") == capped(best, "avx512")
    assert paired_isa_with("avx2") == capped(best, "avx2")


def test_amx_is_taken_only_where_the_gemm_takes_it() -> None:
    chosen = paired_isa_with(None)
    if gemm.default_isa() != "amx":
        assert chosen == best_vector_path()
    else:  # an AMX machine: this build has the AMX path (built with -march=native)
        assert chosen == "amx"


def test_the_paired_layout_is_built_on_every_avx2_cpu() -> None:
    assert kernels.paired_layout(64, 16) == (best_vector_path() is not None)


def test_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"one of \('avx2', 'avx512', 'avx512_bf16', 'amx'\), got 'sse'"):
        kernels.set_paired_isa("sse")
