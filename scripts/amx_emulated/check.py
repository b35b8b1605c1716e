"""Run kvloom's tests against kernels whose AMX paths run on emulated tiles.

The AMX paths of kvloom/csrc (the GEMM's tiles, paired-layout attention's tiles) run only
on CPUs with AMX, which most of our machines lack. This builds gemm.cpp and
paged_attention.cpp with ``kvloom_emu_amx.h`` included first: it says the build has AMX and
stands in for each tile intrinsic with plain C++ over per-thread tile state. The rest of
each kernel stays native, so the CPU must have AVX512-BF16 (what every AMX CPU has too);
the GEMM's run-time dispatch is pinned to AMX and Linux's AMX permission is taken as
granted. The builds go to a temporary ``$KVLOOM_HOME`` under the names
``kvloom.native.load`` looks for, so the tests load them unchanged;
``KVLOOM_TEST_EMULATED_CPU_FLAGS`` tells the tests' CPU-flag helpers the build has AMX.
What this checks: the tile plumbing (configurations, strides, tails, the stores) through
the tests' results and bit-identities, not the hardware's rounding of TDPBF16PS nor speed.

    .venv/bin/python scripts/amx_emulated/check.py     # the GEMM and attention tests
    .venv/bin/python scripts/amx_emulated/check.py tests/models/test_decoder_stack.py
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from kvloom import native

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import emulated_kernels  # noqa: E402 (scripts/emulated_kernels.py)

EMULATED = ("gemm", "paged_attention")
FLAGS = "amx_tile amx_bf16"
DEFAULT_TESTS = ["tests/kernels/test_gemm.py", "tests/kernels/test_paired_attention_path.py", "tests/attention"]
_AMX_TARGET = re.compile(r'#define KVLOOM_TARGET_AMX \\\n\s*__attribute__\(\(target\("[^"]*"\)\)\)')


def _replace(text: str, old: str, new: str, source: str) -> str:
    if old not in text:
        raise SystemExit(f"{source}: {old!r} is not where check.py expects it")
    return text.replace(old, new)


def emulated_source(cpp: Path) -> str:
    """``cpp`` with the tile emulation first, AMX taken as permitted, and (gemm.cpp) its AMX
    functions compiled for AVX512-BF16 and its dispatch pinned to AMX."""
    text = '#include "kvloom_emu_amx.h"\n' + cpp.read_text()
    text = _replace(text, "kvloom_amx::permitted()", "true", cpp.name)
    if cpp.name == "gemm.cpp":
        text, found = _AMX_TARGET.subn("#define KVLOOM_TARGET_AMX KVLOOM_TARGET_AVX512_BF16", text)
        if not found:
            raise SystemExit("gemm.cpp's KVLOOM_TARGET_AMX is not where check.py expects it")
        text = _replace(text, "static const int best = detect_isa();", "static const int best = ISA_AMX;", cpp.name)
    return text


def build(home: Path) -> None:
    """gemm and paged_attention with emulated tiles into ``home``/kernels, under
    kvloom.native's names (the other kernels: this machine's native builds, linked in
    where made already, else built on first use)."""
    emulated_kernels.build(home, EMULATED, emulated_source, HERE, [],
                           r"\b(tdpbf16ps|ldtilecfg|tileloadd|tilestored)\b", "AMX")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help=f"for pytest, options too (default: {' '.join(DEFAULT_TESTS)})")
    args, options = parser.parse_known_args()
    pytest_args = [*args.pytest_args, *options] or DEFAULT_TESTS
    flags = native.cpu_identity().split()
    if "amx_tile" in flags:
        print("this CPU runs AMX itself: `make test` tests its paths natively")
        return 0
    if "avx512_bf16" not in flags:
        print("the emulated tiles build on AVX512-BF16, which this CPU lacks: nothing to check here")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvloom-emu-amx-") as home:
        build(Path(home))
        return emulated_kernels.run_tests(Path(home), FLAGS, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
