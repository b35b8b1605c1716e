"""Which path paired-layout attention takes: one per process, AMX only where the GEMM's
AMX check passed and ``$KVLOOM_CPU_ISA`` allows it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.kernels import gemm
from kvloom.kernels import paged_attention as kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="paged_attention.cpp does not build here")


def paired_isa_with(env_cap: str | None) -> str:
    code = "from kvloom.kernels import paged_attention as k\nk.load()\nprint(k.paired_isa())"
    env = None if env_cap is None else dict(os.environ, KVLOOM_CPU_ISA=env_cap)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parents[2], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_cap_keeps_amx_out() -> None:
    assert paired_isa_with("avx512_bf16") == "avx512_bf16"


def test_amx_is_taken_only_where_the_gemm_takes_it() -> None:
    chosen = paired_isa_with(None)
    if gemm.default_isa() != "amx":
        assert chosen == "avx512_bf16"
    else:  # an AMX machine: this build has the AMX path (built with -march=native)
        assert chosen == "amx"


def test_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="'amx' or 'avx512_bf16', got 'sse'"):
        kernels.set_paired_isa("sse")
