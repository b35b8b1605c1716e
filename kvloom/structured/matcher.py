"""``GrammarMatcher``: one request's position in its grammar.

Invariant (checked every time the runner uses it): the matcher has consumed exactly
the request's output tokens, ``num_consumed == len(request.output_token_ids)``. It
holds because the matcher consumes exactly the tokens the runner returns (sampled
plus forced), the scheduler appends all of them unless the request finishes (and a
finished request's matcher is released), and recompute after preemption re-computes
KV for tokens already in the output without sampling them again.
"""

from __future__ import annotations

import llguidance


class GrammarMatcherError(RuntimeError):
    """The matcher and the request disagree: a bug, never a user error."""


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher`` with the consumed-token count and the
    jump-forward policy of one request."""

    def __init__(self, request_id: str, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...],
                 jump_forward: bool) -> None:
        self.request_id = request_id
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.jump_forward = jump_forward
        self.num_consumed = 0

    def check_in_sync(self, num_output_tokens: int) -> None:
        if self.num_consumed != num_output_tokens:
            raise GrammarMatcherError(
                f"grammar matcher of request {self.request_id!r} consumed {self.num_consumed} tokens "
                f"but the request has {num_output_tokens} output tokens")

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (a proposer's drafts) may be verified from here: the
        prefix the grammar accepts, stopping before any EOS (the target samples or the
        grammar forces EOS itself) and, with jump-forward, before a draft after which the
        grammar forces tokens. That draft is left for the target to sample, so the
        forced tokens follow it exactly as without speculation. Consumes nothing."""
        for count, token_id in enumerate(token_ids):
            if token_id in self.eos_token_ids:
                token_ids = token_ids[:count]
                break
        valid = int(self.matcher.validate_tokens(token_ids)) if token_ids else 0
        if not self.jump_forward or valid == 0:
            return valid
        consumed = 0
        try:
            for index in range(valid):
                self._consume([token_ids[index]], count=False)
                consumed += 1
                if self.matcher.is_stopped() or self.matcher.compute_ff_tokens():
                    return index
            return valid
        finally:
            if consumed and not self.matcher.rollback(consumed):
                raise GrammarMatcherError(f"grammar of request {self.request_id!r} could not roll back "
                                          f"{consumed} drafts: {self.matcher.get_error()}")

    def masks_along(self, draft_token_ids: tuple[int, ...], rows: list[int], width: int) -> None:
        """Write the allowed-token mask at the current position, then after each draft
        (``rows[i]``: the address of row i's ``width`` bytes), and return to where it was.
        The drafts must be a valid prefix (``valid_prefix``)."""
        for index, address in enumerate(rows):
            self.matcher.unsafe_compute_mask_ptr(address, width)
            if index < len(draft_token_ids):
                self._consume([draft_token_ids[index]], count=False)
        if draft_token_ids and not self.matcher.rollback(len(draft_token_ids)):
            raise GrammarMatcherError(f"grammar of request {self.request_id!r} could not roll back "
                                      f"{len(draft_token_ids)} drafts: {self.matcher.get_error()}")

    def advance(self, token_id: int, room: int, accepted: tuple[int, ...] | list[int] = ()) -> list[int]:
        """Consume the verified drafts ``accepted`` (speculative decoding), then the
        sampled token; return up to ``room`` tokens forced after them.

        Forced tokens are llguidance's fast-forward tokens, which it trims so they are
        the tokenizer's canonical tokenization, then EOS once the grammar admits
        nothing else (the request ends without a model step to sample it).
        """
        self._consume(list(accepted))
        if token_id in self.eos_token_ids:
            self._count_eos()
            return []
        self._consume([token_id])
        if not self.jump_forward or room <= 0:
            return []
        forced: list[int] = []
        if not self.matcher.is_stopped():
            forced = self.matcher.compute_ff_tokens()[:room]
            self._consume(forced)
        if self.matcher.is_stopped() and len(forced) < room:
            forced.append(self.eos_token_ids[0])
            self._count_eos()
        return forced

    def _count_eos(self) -> None:
        # EOS ends a constrained request (the scheduler stops on it), so the matcher
        # never needs to see it; the mask only offered it where the grammar is complete
        # (llguidance refuses EOS after a stop it reached by itself).
        self.num_consumed += 1

    def _consume(self, token_ids: list[int], count: bool = True) -> None:
        """``count=False``: a draft looked at while masking, rolled back afterwards."""
        if token_ids and not self.matcher.consume_tokens(token_ids):
            raise GrammarMatcherError(
                f"grammar of request {self.request_id!r} rejected tokens {token_ids}: "
                f"{self.matcher.get_error()}")
        if count:
            self.num_consumed += len(token_ids)
