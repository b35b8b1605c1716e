"""Run kvloom's tests against kernels whose AVX-512 paths are emulated on an AVX2 CPU.

An AVX2-only machine (AMD Zen 1-3, Intel before Skylake-X) cannot run the AVX-512 and
AVX512-BF16 paths of kvloom/csrc, and QEMU cannot emulate them either. This builds
every kernel with ``kvloom_emu512.h`` included first: it defines ``__AVX512F__`` and
friends and maps each ``_mm512_*`` intrinsic the kernels use to SIMDe's portable
version (Debian: ``apt-get install libsimde-dev``), or, where SIMDe 0.7.4 has none, to
a lane-by-lane version after Intel's pseudocode (the reductions in GCC's order,
vdpbf16ps as its two roundings). The GEMM's run-time dispatch is pinned to the
emulated ISA. AMX is not emulated (no tile state here): its paths stay out.

The builds go to a temporary ``$KVLOOM_HOME`` under the names ``kvloom.native.load``
looks for, so the tests load them unchanged; ``KVLOOM_TEST_EMULATED_CPU_FLAGS`` tells
the tests' CPU-flag helpers (tests/helpers_cpu.py) what the build has. What this
checks: results and bit-identities (the AVX2 path against the AVX-512 FMA path, row
invariance), not speed (emulated code runs several times slower) and not denormal
flushing (vdpbf16ps flushes, the emulation does not).

    .venv/bin/python scripts/avx512_emulated/check.py              # tests/kernels, tests/attention
    .venv/bin/python scripts/avx512_emulated/check.py tests/models -k packed  # other tests
    .venv/bin/python scripts/avx512_emulated/check.py --isa avx512 # AVX-512 without BF16
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

SIMDE = Path("/usr/include/simde/x86/avx512.h")
# Per emulated ISA: the flags it adds to /proc/cpuinfo's, gemm.cpp's enum for it, and the
# defines that pick the header's part.
ISAS = {"avx512_bf16": ("avx512f avx512bw avx512vl avx512dq avx512_bf16", "ISA_AVX512_BF16", []),
        "avx512": ("avx512f avx512bw avx512vl avx512dq", "ISA_AVX512", ["-DKVLOOM_EMU_NO_BF16"])}
_TARGET = re.compile(r'__attribute__\(\(target\("[^"]*"\)\)\)')


def emulated_source(cpp: Path, gemm_isa: str) -> str:
    """``cpp`` with the emulation header first; gemm.cpp also loses its AVX-512 target
    attributes (GCC would emit real AVX-512 in those functions) and its CPU probe."""
    text = '#include "kvloom_emu512.h"\n' + cpp.read_text()
    if cpp.name == "gemm.cpp":
        amx = re.search(r"#define KVLOOM_TARGET_AMX \\\n\s*" + _TARGET.pattern, text)
        if amx is None:
            raise SystemExit("gemm.cpp's KVLOOM_TARGET_AMX is not where check.py expects it")
        text = text.replace(amx.group(0), '#define KVLOOM_TARGET_AMX __attribute__((target("amx-tile,amx-bf16")))')
        for macro in ("KVLOOM_TARGET_AVX512", "KVLOOM_TARGET_AVX512_BF16"):
            text, found = re.subn(rf"#define {macro} {_TARGET.pattern}", f"#define {macro}", text)
            if not found:
                raise SystemExit(f"gemm.cpp's {macro} is not where check.py expects it")
        probe = "static const int best = detect_isa();"
        if probe not in text:
            raise SystemExit("gemm.cpp's ISA probe is not where check.py expects it")
        text = text.replace(probe, f"static const int best = {gemm_isa};")
    if 'target("avx512' in text:
        raise SystemExit(f"{cpp.name} keeps an AVX-512 target attribute: the build would emit AVX-512")
    return text


def build(home: Path, gemm_isa: str, defines: list[str]) -> None:
    """Every kernel, emulated, into ``home``/kernels under kvloom.native's names."""
    emulated_kernels.build(home, None, lambda cpp: emulated_source(cpp, gemm_isa), HERE, defines, "%zmm", "AVX-512")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", choices=sorted(ISAS), default="avx512_bf16", help="the ISA to emulate")
    parser.add_argument("pytest_args", nargs="*",
                        help="for pytest, options too (default: tests/kernels tests/attention)")
    args, options = parser.parse_known_args()
    pytest_args = [*args.pytest_args, *options] or ["tests/kernels", "tests/attention"]
    if "avx512f" in native.cpu_identity().split():
        print("this CPU runs AVX-512 itself: `make test` tests its paths natively")
        return 0
    if not SIMDE.exists():
        raise SystemExit(f"{SIMDE} is missing: apt-get install libsimde-dev")
    flags, gemm_isa, defines = ISAS[args.isa]
    with tempfile.TemporaryDirectory(prefix="kvloom-emu512-") as home:
        build(Path(home), gemm_isa, defines)
        return emulated_kernels.run_tests(Path(home), flags, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
