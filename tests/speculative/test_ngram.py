"""Prompt lookup against a plain-Python reference: the longest suffix (up to
prompt_lookup_max tokens, at least prompt_lookup_min) found earlier in the tokens,
the most recent occurrence among the longest, and what followed it."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvloom.request import Request
from kvloom.sampling_params import SamplingParams
from kvloom.speculative.ngram import NgramProposer, lookup


def reference(tokens: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, not the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + count]
    return []


def test_hand_computed_cases() -> None:
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4]
    # Suffix [3, 4]: last seen at 6-7 (followed by 7, 3, 4), before that at 2-3.
    assert lookup(np.array(tokens), 3, 1, 2) == [7, 3, 4]
    # Three tokens [4, 3, 4] never occurred before; [3, 4] did.
    assert lookup(np.array(tokens), 2, 1, 3) == [7, 3]
    assert lookup(np.array([5, 6, 7]), 2, 1, 3) == []  # 7 never occurred before
    assert lookup(np.array([5, 6, 5]), 4, 1, 3) == [6, 5]  # runs up to the end
    assert lookup(np.array([5, 6, 5]), 4, 2, 3) == []  # a 1-token match is too short


@given(st.lists(st.integers(0, 5), min_size=0, max_size=60), st.integers(1, 6),
       st.integers(1, 4), st.integers(0, 3))
def test_matches_the_reference(tokens, count, max_n, shorter) -> None:
    min_n = max(1, max_n - shorter)
    assert lookup(np.array(tokens, dtype=np.int64), count, min_n, max_n) == \
        reference(tokens, count, min_n, max_n)


def test_proposer_follows_a_growing_request() -> None:
    request = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    proposer = NgramProposer(1, 3)
    assert proposer.propose([request], [2]) == [[3, 1]]
    for token in (3, 8, 1, 2):
        request.append_output_token(token)
    assert proposer.propose([request], [5]) == [reference(request.all_token_ids, 5, 1, 3)]
    proposer.release("a")
    assert not proposer._buffers
