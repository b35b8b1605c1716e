"""What this machine's CPU is: Linux's feature flags (the native code is built with
-march=native, so they say which kernel paths a build has)."""

from __future__ import annotations

from pathlib import Path

HAS_CPUINFO = Path("/proc/cpuinfo").exists()


def cpu_flags() -> set[str]:
    """The first CPU's flags from /proc/cpuinfo (all cores are alike); empty elsewhere."""
    if not HAS_CPUINFO:
        return set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 itself (AVX512-BF16), rather than through float32."""
    return "avx512_bf16" in cpu_flags()
