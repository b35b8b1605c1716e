"""The paired-layout kernel's paths: the tests that use ``paired_path`` run once per
path this machine has (vdpbf16ps's arithmetic as FMAs on any AVX-512 CPU, vdpbf16ps
itself where the CPU has AVX512-BF16, AMX where it has that), the process's own choice
restored after each."""

from __future__ import annotations

import pytest

from kvloom.kernels import paged_attention as kernels


def _paired_paths() -> list[str]:
    if not (kernels.available() and kernels.paired_layout(64, 16)):
        return ["none"]  # no paired layout here: the token-major kernels only
    paths = [isa for isa in kernels.PAIRED_ISAS if kernels.set_paired_isa(isa) == isa]
    kernels.set_paired_isa(kernels.paired_isa())
    return paths


@pytest.fixture(params=_paired_paths())
def paired_path(request: pytest.FixtureRequest):
    if request.param != "none":
        kernels.set_paired_isa(request.param)
    yield request.param
    if request.param != "none":
        kernels.set_paired_isa(kernels.paired_isa())
