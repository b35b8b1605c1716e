"""N-gram proposer (prompt lookup): the request's last n tokens, found earlier in its
own prompt and output, predict that what followed them then follows now.

No model: a copy of the request's tokens in a growing NumPy buffer (appended to, never
rebuilt: verified tokens never change), and per lookup one vectorised pass for the
positions holding the last token, then a few for how far back each match extends.
The longest match wins (at most ``prompt_lookup_max``, at least ``prompt_lookup_min``
tokens), the most recent among equals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvloom.lora.manager import LoRAManager
from kvloom.request import Request
from kvloom.speculative.proposer import TargetModel


class _TokenBuffer:
    """A request's tokens as int64, capacity doubled as they grow."""

    __slots__ = ("tokens", "length")

    def __init__(self) -> None:
        self.tokens = np.empty(64, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The buffer holding ``token_ids`` (a longer version of what it held)."""
        if len(token_ids) < self.length:  # not an extension: start over
            self.length = 0
        if len(token_ids) > self.tokens.shape[0]:
            grown = np.empty(max(len(token_ids), 2 * self.tokens.shape[0]), dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        self.tokens[self.length:len(token_ids)] = token_ids[self.length:]
        self.length = len(token_ids)
        return self.tokens[:self.length]


def lookup(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``tokens`` (between ``min_n`` and ``max_n`` long)."""
    length = tokens.shape[0]
    if length < min_n + 1 or num_tokens <= 0:
        return []
    # Match ends: earlier positions holding the last token (not the last position).
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.shape[0], dtype=np.int64)  # suffix tokens each end matches
    alive = np.ones(ends.shape[0], dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        # A match extends while the token `back` before its end equals the suffix's.
        before = ends - back
        extends = alive & (before >= 0)
        extends[extends] = tokens[before[extends]] == tokens[length - 1 - back]
        matched += extends
        alive = extends
        if not alive.any():
            break
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the most recent of the longest
    return [int(token) for token in tokens[end + 1:end + 1 + num_tokens]]


class NgramProposer:
    name = "ngram"
    draft_cost = 0.0  # host work only, well under a step

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, count in zip(requests, num_tokens, strict=True):
            buffer = self._buffers.get(request.request_id)
            if buffer is None:
                buffer = self._buffers[request.request_id] = _TokenBuffer()
            drafts.append(lookup(buffer.sync(request.all_token_ids), count, self.min_n, self.max_n))
        return drafts

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def check_integrity(self) -> None:
        pass  # no blocks: a buffer per request, dropped by release

    def use_adapters(self, lora: LoRAManager) -> None:
        pass  # the request's own tokens are the guesses, adapter or not


def build(target: TargetModel) -> NgramProposer:
    spec = target.config.speculative_config
    assert spec is not None
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
