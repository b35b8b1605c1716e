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
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvloom import native

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
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
    kvloom.native's names (the other kernels build natively on first use), both at once."""
    cxx = native.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    os.environ["KVLOOM_HOME"] = str(home)  # native.cache_dir() reads it
    with tempfile.TemporaryDirectory() as tmp:
        sources = Path(tmp) / "csrc"
        shutil.copytree(native.SOURCES, sources)

        def compile_one(name: str) -> None:
            cpp = sources / f"{name}.cpp"
            cpp.write_text(emulated_source(cpp))
            target = native.cache_dir() / f"{name}-{native.build_key(name, cxx)}.so"
            try:
                native.compile_library(cpp, target, [*native.flags_for(name), "-I", str(HERE)])
            except native.KernelUnavailable as error:
                raise SystemExit(f"emulated: {error}") from None
            disassembly = subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True).stdout
            if re.search(r"\b(tdpbf16ps|ldtilecfg|tileloadd|tilestored)\b", disassembly):
                raise SystemExit(f"{target.name} holds real AMX instructions")
            print(f"built {name} (AMX emulated)", flush=True)

        with ThreadPoolExecutor(len(EMULATED)) as pool:
            list(pool.map(compile_one, EMULATED))


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
        env = dict(os.environ, KVLOOM_HOME=home, KVLOOM_TEST_EMULATED_CPU_FLAGS=FLAGS)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                              cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
