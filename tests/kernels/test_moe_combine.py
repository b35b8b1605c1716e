"""cpu_ops.moe_combine (a mixture-of-experts layer's weighted expert outputs added up per
token) against the torch ops it replaces, ``(y * w).to(dtype)`` and one ``index_add_`` per
expert in ascending order onto zeros: bit for bit in float32 and bf16, with float32 and
bf16 routing weights, tokens with fewer rows (another rank's experts), products and sums
that round either way, and the signs of zeros."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build cpu_ops.cpp")


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    integer = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    return torch.equal(got.view(integer), expected.view(integer))


def torch_combine(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The reference: each token's rows in pairs' order, one rounded product and one rounded
    add each, as torch computes them (an index_add_ of one row per token at a time)."""
    out = torch.zeros(pairs.shape[0], y.shape[1], dtype=y.dtype)
    for r in range(pairs.shape[1]):
        tokens = (pairs[:, r] >= 0).nonzero().view(-1)
        rows = pairs[tokens, r]
        out.index_add_(0, tokens, (y[rows] * weights[rows].unsqueeze(-1)).to(y.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "n"), [(1, 2, 7), (5, 8, 16), (40, 2, 1000), (300, 8, 96)])
def test_every_token_is_torchs_sum(dtype: torch.dtype, weight_dtype: torch.dtype, tokens: int, k: int,
                                   n: int) -> None:
    generator = torch.Generator().manual_seed(tokens * k + n)
    rows = tokens * k
    magnitudes = torch.exp2(torch.randint(-8, 8, (rows, n), generator=generator).float())
    y = (torch.randn(rows, n, generator=generator) * magnitudes).to(dtype)
    y.view(-1)[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0], dtype=dtype)  # zero products of either sign
    weights = torch.rand(rows, generator=generator).to(weight_dtype)
    pairs = torch.randperm(rows, generator=generator).view(tokens, k)
    pairs[::3, -1] = -1  # every third token lacks its last row (another rank's expert)
    got = cpu_ops.moe_combine(y, weights.float(), pairs)
    assert same_bits(got, torch_combine(y, weights, pairs))


def test_a_token_without_rows_is_zero() -> None:
    y = torch.randn(2, 8).bfloat16()
    out = cpu_ops.moe_combine(y, torch.ones(2), torch.tensor([[-1, -1], [1, 0]]))
    assert same_bits(out[0], torch.zeros(8, dtype=torch.bfloat16))
    assert same_bits(out[1], torch_combine(y, torch.ones(2), torch.tensor([[1, 0]]))[0])
