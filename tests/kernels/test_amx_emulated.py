"""The AMX paths on emulated tiles (scripts/amx_emulated/): where the CPU has AVX512-BF16
but no AMX, the GEMM's and paired attention's AMX cases and the decoder stack's tests run
against builds whose tile instructions are plain C++, so that every such machine checks the tile plumbing
(configurations, strides, tails, stores) that only AMX machines run natively. On an AMX
CPU this suite runs those cases natively instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_cpu import EMULATED_FLAGS_ENV

from kvloom import native

ROOT = Path(__file__).resolve().parents[2]
REAL_FLAGS = set(native.cpu_identity().split())  # this CPU's own, not an emulated build's


@pytest.mark.skipif("amx_tile" in REAL_FLAGS, reason="this CPU runs the AMX cases natively in this suite")
@pytest.mark.skipif("amx_tile" in os.environ.get(EMULATED_FLAGS_ENV, ""), reason="this run is the emulated one")
@pytest.mark.skipif("avx512_bf16" not in REAL_FLAGS, reason="the emulated tiles build on AVX512-BF16")
def test_the_amx_paths_pass_their_tests_on_emulated_tiles() -> None:
    # The kernels' AMX cases, and the decoder stack (its matmuls and attention on the AMX
    # paths there) against the module path for families whose shapes and layers differ most
    # (heads of 32, 64 and 256 dims, q/k head norms, block norms and softcaps, windows, norms
    # after the blocks, a partial rotary, blocks side by side, a layer without rotary); the
    # other families walk the same kernels at those shapes (97 -> 43 s of emulated tiles). Its
    # hybrids' tests add state layers, which have no AMX path, and its mixture-of-experts tests
    # the grouped GEMM, whose AMX tiles test_gemm's grouped cases run: all in the plain suite.
    tests = ["tests/kernels/test_gemm.py", "tests/kernels/test_paired_attention_path.py", "tests/attention",
             "tests/models/test_decoder_stack.py"]
    result = subprocess.run([sys.executable, "scripts/amx_emulated/check.py", *tests,
                             "-k", "amx or (test_decoder_stack and not hybrid and not moe and (llama or qwen3 "
                                   "or gemma2 or mistral or olmo2 or phi3 or stablelm_parallel or cohere2 "
                                   "or gpt2))"], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed is not None and int(passed.group(1)) >= 150, report  # the AMX cases ran, not none
