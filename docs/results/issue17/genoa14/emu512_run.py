"""Run scripts/avx512_emulated's check from an AVX-512 machine: its builds compiled for an AVX2 CPU
(-march=znver3 in place of -march=native, under kvloom.native's usual names), then the tests."""
import os, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, "scripts/avx512_emulated")
import check
from kvloom import native
real_compile = native.compile_library
def compile_library(src, target, flags):
    return real_compile(src, target, ["-march=znver3" if f == "-march=native" else f for f in flags])
native.compile_library = compile_library
isa = sys.argv[1]
flags, gemm_isa, defines = check.ISAS[isa]
with tempfile.TemporaryDirectory(prefix="kvloom-emu512-") as home:
    check.build(Path(home), gemm_isa, defines)
    env = dict(os.environ, KVLOOM_HOME=home, KVLOOM_TEST_EMULATED_CPU_FLAGS=flags)
    sys.exit(subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sys.argv[2:]], env=env).returncode)
