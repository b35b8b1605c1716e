"""cpu_ops.add_rows_ (LoRA's deltas added in, by the module path and the native walk)
against torch's own ``y += delta`` and ``index_add_``: bit for bit in float32 and bf16,
over row widths that end inside a vector, sums that round either way and the
specials; and every bad argument refused by name."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build cpu_ops.cpp")


def values(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values over a wide range of magnitudes (so that sums round up, down and to
    even) with an inf, a -inf and a NaN among them."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-20, 20, shape, generator=generator).float())
    flat = x.view(-1)
    flat[: min(3, flat.numel())] = torch.tensor([float("inf"), float("-inf"), float("nan")])[: min(3, flat.numel())]
    return x.to(dtype)


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bit for bit (the sign of a zero included), NaN where NaN (its payload aside)."""
    integer = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    nan = expected.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(integer)[~nan], expected.view(integer)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (3, 7), (5, 16), (16, 960), (40, 1000)])  # 40 x 1000: threads split
def test_every_row_is_torchs_add(dtype: torch.dtype, rows: int, n: int) -> None:
    y, delta = values((rows, n), dtype, 1), values((rows, n), dtype, 2)
    expected = y.clone()
    expected += delta
    cpu_ops.add_rows_(y, delta)
    assert same_bits(y, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_named_rows_are_torchs_index_add(dtype: torch.dtype) -> None:
    y, delta = values((30, 77), dtype, 3), values((6, 77), dtype, 4)
    rows = torch.tensor([29, 0, 5, 6, 17, 2])  # distinct, in any order
    expected = y.clone().index_add_(0, rows, delta)
    cpu_ops.add_rows_(y, delta, rows)
    assert same_bits(y, expected)


def test_bad_arguments_are_refused_by_name() -> None:
    y = torch.zeros(4, 8, dtype=torch.bfloat16)
    cases = [
        ((y, torch.zeros(4, 9, dtype=torch.bfloat16), None), "delta"),  # another width
        ((y, torch.zeros(3, 8, dtype=torch.bfloat16), None), "delta"),  # fewer rows, none named
        ((y, torch.zeros(4, 8, dtype=torch.float32), None), "delta"),  # another dtype
        ((y, torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([0])), "rows"),  # one row short
        ((y, torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([0, 4])), "rows"),  # past the end
        ((y, torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([-1, 0])), "rows"),
        ((y, torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([0, 1], dtype=torch.int32)), "rows"),
        ((y.t(), torch.zeros(8, 4, dtype=torch.bfloat16), None), "y"),  # not contiguous
    ]
    for arguments, name in cases:
        with pytest.raises(ValueError, match=name):
            cpu_ops.add_rows_(*arguments)
    assert torch.equal(y, torch.zeros(4, 8, dtype=torch.bfloat16))  # nothing written by a refused call
