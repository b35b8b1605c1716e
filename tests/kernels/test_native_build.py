"""Loading our native libraries leaves the process's floating-point state alone (a
library linked with -ffast-math would switch on flush-to-zero for the whole process at
load time), and the build cache key covers the CPU."""

from __future__ import annotations

import subprocess
import sys

from kvloom import native

LOAD_ALL_THEN_CHECK_SUBNORMALS = """
import sys
from kvloom import native
for name in ("cpu_ops", "paged_attention", "sampling", "gemm"):
    native.load(name)
tiny = sys.float_info.min  # the smallest normal double; half of it is subnormal
assert tiny / 2 > 0, "flush-to-zero is on after loading the kernels"
import torch
assert torch.tensor(1e-40, dtype=torch.float32).item() != 0, "denormals-are-zero is on"
print("ok")
"""


def test_loading_the_kernels_keeps_subnormals() -> None:
    # A fresh process: this one may have loaded the libraries already.
    result = subprocess.run([sys.executable, "-c", LOAD_ALL_THEN_CHECK_SUBNORMALS], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_cache_key_names_the_cpu(monkeypatch) -> None:
    import shutil

    compiler = shutil.which("g++")
    assert compiler is not None
    here = native.build_key("gemm", compiler)
    assert native.build_key("gemm", compiler) == here  # stable
    monkeypatch.setattr(native, "cpu_identity", lambda: "model name : another CPU\nflags : sse2")
    assert native.build_key("gemm", compiler) != here  # another CPU never loads this build
