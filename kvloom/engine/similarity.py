"""Bi-encoder similarity, vLLM's Score and Rerank for embedding models: each text is
embedded on its own (last-token pooling, ``SamplingParams.pooling`` "embed") and a pair's score
is the cosine of its two embeddings. The server's ``/score`` and ``/rerank``
(server/serving_rerank.py) and ``LLM.score`` pair texts by the same rule."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pair_up(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """vLLM's pairing of two lists of texts: 1:1, 1:N (the one first text against each
    second one) or N:N (element by element). Returns the (first, second) index pairs, in
    the order of the second list."""
    if num_first == 0:
        raise ValueError("at least one text must be given on the first side")
    if num_second == 0:
        raise ValueError("at least one text must be given on the second side")
    if num_first > 1 and num_first != num_second:
        raise ValueError(f"the two sides pair 1:1, 1:N or N:N; got {num_first} and {num_second} texts")
    return [(0 if num_first == 1 else index, index) for index in range(num_second)]


def cosine_scores(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]],
                  pairs: Sequence[tuple[int, int]]) -> list[float]:
    """Each pair's cosine similarity, in float32 (as vLLM computes it)."""
    left = torch.tensor([list(first[i]) for i, _ in pairs], dtype=torch.float32)
    right = torch.tensor([list(second[j]) for _, j in pairs], dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(left, right, dim=-1).tolist()
