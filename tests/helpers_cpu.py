"""What this machine's CPU is: Linux's feature flags (the native code is built with
-march=native, so they say which kernel paths a build has)."""

from __future__ import annotations

import os
from pathlib import Path

HAS_CPUINFO = Path("/proc/cpuinfo").exists()
# Flags a build has beyond the CPU's: scripts/avx512_emulated/check.py runs the tests
# against kernels built with AVX-512 emulated on an AVX2 CPU and names them here.
EMULATED_FLAGS_ENV = "KVLOOM_TEST_EMULATED_CPU_FLAGS"


def cpu_flags() -> set[str]:
    """The first CPU's flags from /proc/cpuinfo (all cores are alike; empty elsewhere),
    with those of an emulated build (EMULATED_FLAGS_ENV)."""
    emulated = set(os.environ.get(EMULATED_FLAGS_ENV, "").split())
    if not HAS_CPUINFO:
        return emulated
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split()) | emulated
    return emulated


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 itself (AVX512-BF16), rather than through float32."""
    return "avx512_bf16" in cpu_flags()
