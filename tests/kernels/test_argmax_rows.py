"""Greedy sampling's native argmax (kvloom::argmax_rows) against torch.argmax, on the
cases where a vector kernel can go wrong: rows whose length is no multiple of the
vector width (a tail), ties between lanes and across the tail, NaN anywhere (the first
NaN wins, as in torch), rows that are all -inf, a single column."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import sampling

pytestmark = pytest.mark.skipif(not sampling.ARGMAX_ROWS.available(), reason="sampling.cpp does not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 15, 16, 17, 100, 49152, 49155])
def test_random_rows_are_torch_argmax(dtype: torch.dtype, vocab: int) -> None:
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(sampling.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nan_and_minus_infinity_go_as_in_torch(dtype: torch.dtype) -> None:
    vocab = 37  # four 8-lane steps, two 16-lane ones, and a tail on both
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(5)).to(dtype)
    top = logits.max() + 1
    logits[0, [3, 12, 30]] = top        # ties in different lanes: the first wins
    logits[1, [9, 1]] = top             # the lower index sits in a later lane
    logits[2, [34, 36]] = top           # ties in the tail only
    logits[3, [20, 33]] = top           # a vector-part maximum and an equal one in the tail
    logits[4, :] = float("-inf")        # nothing but -inf: index 0
    logits[5, 17] = float("nan")        # a NaN beats everything
    logits[6, [4, 25]] = float("nan")   # the first NaN
    logits[7, 35] = float("nan")        # a NaN in the tail, after a finite maximum
    logits[7, 2] = top
    logits[8, :] = 0.25                 # all tied
    logits[9, 0] = top                  # the maximum at index 0
    assert torch.equal(sampling.argmax_rows(logits), logits.argmax(dim=-1))
