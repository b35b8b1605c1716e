"""Structured output's native mask (kvloom::apply_token_bitmask_) against the PyTorch
reference that unpacks every bit (runner/sampler.py ``apply_token_bitmask_reference``):
random masks and the shapes a free-text grammar gives (words of all ones skipped), a
vocabulary that ends inside a word, rows named out of order, bits past the vocabulary,
both dtypes; and its argument checks."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import sampling
from kvloom.runner.sampler import apply_token_bitmask, apply_token_bitmask_reference
from kvloom.structured.mask import GrammarMask

pytestmark = pytest.mark.skipif(not sampling.APPLY_TOKEN_BITMASK.available(),
                                reason="sampling.cpp does not build here")


def masks(count: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (count, width), generator=generator, dtype=torch.int64).to(torch.int32)
    words[0] = -1                                           # everything allowed
    if count > 1:
        words[1] = -1
        words[1, width // 2] = ~(1 << 7)                    # free text: one token forbidden
    if count > 2:
        words[2] = 0
        words[2, 0] = 1 << 3                                # one token allowed (a forced key)
    return words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152, 49155])
def test_the_native_mask_is_the_reference(dtype: torch.dtype, vocab: int) -> None:
    width = (vocab + 31) // 32
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    grammar = GrammarMask(torch.tensor([5, 0, 3, 6]), masks(4, width, vocab))
    expected = apply_token_bitmask_reference(logits.clone(), grammar)
    native = logits.clone()
    sampling.apply_token_bitmask_(native, grammar.rows, grammar.bitmask)
    assert torch.equal(native, expected)
    assert torch.equal(apply_token_bitmask(logits.clone(), grammar), expected)  # the sampler's entry point
    assert torch.equal(native[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a grammar untouched


def test_bad_arguments_are_named() -> None:
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="rows must name one row of logits per bitmask row"):
        sampling.apply_token_bitmask_(logits, torch.tensor([0]), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must hold a bit per token"):
        sampling.apply_token_bitmask_(logits, torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 2\)"):
        sampling.apply_token_bitmask_(logits, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))
