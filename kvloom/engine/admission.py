"""Whether a request can ever be served: the one set of admission checks.

The engine runs them on every request it queues; the server runs the same ones before
it fans a request out into choices, so that a request is refused whole, with the
OpenAI ``param`` and ``code``, before any part of it is queued.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvloom.cache.windows import blocks_held_at_most


class RequestRejected(ValueError):
    """A request that can never be served (too long for the pool or the model, token
    ids outside the vocabulary, ...).

    ``param`` names the request field to change and ``code`` the reason, as OpenAI's
    error objects carry them."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What a request must fit: the model's context and vocabulary, the KV pool."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_logprobs: int = 20  # the most top logprobs a request may ask for (the config's, -1 resolved)
    # A sliding window in every layer (ModelConfig.kv_window, 0: none): a request then holds
    # its prompt and the blocks its window and a step's chunk cover, not its whole sequence
    # (cache/kv_manager.py). ``chunk_tokens``: the most tokens a step computes for one request.
    window: int = 0
    chunk_tokens: int = 0

    def check_prompt(self, num_prompt_tokens: int, param: str = "prompt") -> None:
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty: it must contain at least one token", param,
                                  "empty_prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"is {num_prompt_tokens} tokens (it must leave room for at least one output token)",
                param, "context_length_exceeded")

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens for a request that gives none: up to the context, and never more
        than the whole KV pool holds (capped there, not refused as too large for it)."""
        capacity = min(self.max_model_len, self.num_blocks * self.block_size)
        if self.window and self.blocks_held_at_most(num_prompt_tokens, self.max_model_len - num_prompt_tokens) \
                <= self.num_blocks:
            capacity = self.max_model_len
        return max(1, capacity - num_prompt_tokens)

    def blocks_held_at_most(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most KV blocks a request holds at once (cache/kv_manager.py's count, with
        this engine's window and chunk)."""
        return blocks_held_at_most(self.block_size, self.window, num_prompt_tokens, max_tokens, self.chunk_tokens)

    def check_fits_pool(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The blocks the request holds at once (prompt + max_tokens, less under a sliding
        window) must fit the whole KV pool, or the request could never run."""
        needed = self.blocks_held_at_most(num_prompt_tokens, max_tokens)
        if needed > self.num_blocks:
            raise RequestRejected(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
                f"blocks, but the whole pool has {self.num_blocks} blocks of {self.block_size} tokens",
                "max_tokens", "kv_pool_too_small")

    def truncate(self, token_ids: list[int], keep: int | None, keep_first: bool = False) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (its first
        with ``keep_first``; -1: ``max_model_len`` of them); None leaves it whole."""
        if keep is None:
            return token_ids
        if isinstance(keep, bool) or not isinstance(keep, int) or not (1 <= keep <= self.max_model_len or keep == -1):
            raise RequestRejected(f"truncate_prompt_tokens must be in [1, {self.max_model_len}] or -1 (the context "
                                  f"length), got {keep!r}", "truncate_prompt_tokens", "invalid_value")
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[:keep] if keep_first else token_ids[-keep:]

    def check_token_ids(self, token_ids: Iterable[object], param: str) -> None:
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"{param} must be token ids in [0, {self.vocab_size}), got {bad[:3]}",
                                  param, "invalid_token_id")

    def check_logprobs(self, num_logprobs: int | None, param: str) -> None:
        """A request's ``logprobs`` or ``prompt_logprobs`` within the server's max_logprobs."""
        if num_logprobs is not None and num_logprobs > self.max_logprobs:
            raise RequestRejected(f"{param} asks for {num_logprobs} log-probabilities a token, more than this "
                                  f"server's max_logprobs ({self.max_logprobs}; --max-logprobs raises it)",
                                  param, "invalid_value")
