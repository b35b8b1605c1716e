"""The paired-layout kernel's paths: the tests that use ``paired_path`` run once per
path this machine has (AVX512-BF16, and AMX where the CPU has it), the process's own
choice restored after each."""

from __future__ import annotations

import pytest

from kvloom.kernels import paged_attention as kernels


def _paired_paths() -> list[str]:
    if not (kernels.available() and kernels.paired_layout(64, 16)):
        return ["none"]  # no paired layout here: the token-major kernels only
    paths = ["avx512_bf16"]
    if kernels.set_paired_isa("amx"):
        paths.append("amx")
    kernels.set_paired_isa(kernels.paired_isa())
    return paths


@pytest.fixture(params=_paired_paths())
def paired_path(request: pytest.FixtureRequest):
    if request.param != "none":
        kernels.set_paired_isa(request.param)
    yield request.param
    if request.param != "none":
        kernels.set_paired_isa(kernels.paired_isa())
