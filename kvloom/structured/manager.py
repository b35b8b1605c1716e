"""Runner-side structured output: per-request matchers, batched masks, forced tokens.

The ``ModelRunner`` owns one ``StructuredOutputManager``. Requests without a
constraint never reach it, and a step whose sampling rows are all unconstrained
costs one dict lookup per row: no bitmask is allocated, filled or applied.

A constraint with ``after_token_id`` (a reasoning model's answer after its reasoning; a
sequence of ids: GPT-OSS's final channel) waits in ``_waiting`` with its matcher unstarted:
its rows are free, its drafts are cut before the token that would complete the trigger (so
that token is only ever sampled, never verified as a draft), and the step that samples it
starts the matcher, which from then on counts the output tokens before it as consumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import llguidance
import torch

from kvloom.request import Request, RequestError
from kvloom.structured.compiler import CompiledGrammar, GrammarCompiler
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.mask import GrammarMask
from kvloom.structured.matcher import GrammarMatcher
from kvloom.tokenizer import Tokenizer


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: one bit per token id."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Compiles constraints (lazily building the llguidance tokenizer on first use)
    and keeps each constrained request's ``GrammarMatcher`` until it is released."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._compiler: GrammarCompiler | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, GrammarMatcher] = {}
        # Requests whose constraint starts after tokens not yet sampled: those ids (the
        # output must end with them) and the matcher they will start.
        self._waiting: dict[str, tuple[tuple[int, ...], GrammarMatcher]] = {}

    # ---- requests --------------------------------------------------------------------
    def compile(self, constraint: StructuredOutput | None, tokenizer: Tokenizer,
                eos_token_ids: Sequence[int]) -> CompiledGrammar | None:
        """The constraint's grammar (None for none); ValueError if it is invalid."""
        if constraint is None:
            return None
        return self.compiler(tokenizer, eos_token_ids).compile(constraint)

    def compiler(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        """The compiler, built on first use (the llguidance tokenizer takes ~0.3 s)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids)
        elif self._compiler.tokenizer is not tokenizer:
            raise ValueError("one runner serves one tokenizer; got a different one")
        return self._compiler

    def add_request(self, request: Request, grammar: CompiledGrammar | None) -> None:
        """Start the request's matcher on ``grammar`` (nothing to do for None)."""
        if grammar is None:
            return
        constraint = request.sampling_params.structured
        assert constraint is not None and constraint.cache_key == grammar.key
        assert self._compiler is not None  # it compiled `grammar`
        matcher = GrammarMatcher(request.request_id, grammar.new_matcher(), self._compiler.eos_token_ids,
                                 constraint.jump_forward)
        trigger = constraint.after_token_id
        if trigger is None:
            self._matchers[request.request_id] = matcher
        else:
            self._waiting[request.request_id] = (trigger if isinstance(trigger, tuple) else (trigger,), matcher)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    @property
    def num_active(self) -> int:
        return len(self._matchers) + len(self._waiting)

    @property
    def num_waiting(self) -> int:
        """Requests whose constraint has not started: ``advance`` must see their tokens."""
        return len(self._waiting)

    # ---- one step --------------------------------------------------------------------
    def _constrained(self, requests: Sequence[Request]) -> list[tuple[int, GrammarMatcher]]:
        """(row, matcher) of the rows with a grammar, each checked to be in sync."""
        if not self._matchers:
            return []
        rows = []
        for row, request in enumerate(requests):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                matcher.check_in_sync(request.num_output_tokens)
                rows.append((row, matcher))
        return rows

    def valid_drafts(self, request: Request, draft_token_ids: list[int]) -> list[int]:
        """The longest prefix of a proposer's drafts that the request's grammar accepts
        (all of them for an unconstrained request): speculative decoding verifies only
        tokens the grammar allows, so a rejected draft never reaches the model."""
        waiting = self._waiting.get(request.request_id)
        if waiting is not None:  # the constraint's start is sampled, never a draft
            trigger = waiting[0]
            for index in range(len(draft_token_ids)):
                if _ends_with(request.output_token_ids, draft_token_ids[:index + 1], trigger):
                    return draft_token_ids[:index]
            return draft_token_ids
        matcher = self._matchers.get(request.request_id)
        if matcher is None or not draft_token_ids:
            return draft_token_ids
        try:
            return draft_token_ids[:matcher.valid_prefix(draft_token_ids)]
        except Exception:  # noqa: BLE001 - no drafts; the step itself reports a broken grammar
            return []

    def grammar_mask(self, sampling: Sequence[tuple[Request, tuple[int, ...]]],
                     failures: dict[str, RequestError]) -> GrammarMask | None:
        """Allowed next tokens of every constrained row, or None when no row is
        constrained. ``sampling`` holds the sampling requests in order with their drafts:
        a request has one row at its last known token, then one after each draft (the
        grammar's state once that draft is consumed; drafts are ``valid_drafts``).

        A row whose grammar cannot go on (llguidance's matcher in its error state, e.g.
        a grammar that exceeds its limits) is recorded in ``failures`` and gets a mask
        that allows everything: it is sampled with the batch, and the engine fails that
        request alone and discards its token."""
        constrained = self._constrained([request for request, _ in sampling])
        if not constrained:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        first_rows = list(itertools.accumulate((1 + len(drafts) for _, drafts in sampling), initial=0))
        width = bitmask_width(self.vocab_size)
        rows: list[int] = []  # sampling rows, in the bitmask's order
        plain: list[tuple[int, GrammarMatcher]] = []  # (bitmask row, matcher) at one position
        drafted: list[tuple[list[int], GrammarMatcher, tuple[int, ...]]] = []
        for index, matcher in constrained:
            drafts = sampling[index][1]
            start = len(rows)
            rows.extend(range(first_rows[index], first_rows[index] + 1 + len(drafts)))
            if drafts:
                drafted.append((list(range(start, len(rows))), matcher, drafts))
            else:
                plain.append((start, matcher))
        # Filled on the host by llguidance (in parallel across rows), then copied once.
        bitmask = torch.empty((len(rows), width), dtype=torch.int32)  # [C, W]
        try:
            if plain:
                self._executor.unsafe_compute_mask_ptr(
                    [(matcher.matcher, row) for row, matcher in plain], bitmask.data_ptr(), width * 4, len(rows))
        except Exception:  # noqa: BLE001 - one row's grammar raised: find it row by row
            for row, matcher in plain:
                try:
                    matcher.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), width * 4)
                except Exception as error:  # noqa: BLE001 - attributed to that request
                    failures[matcher.request_id] = RequestError(f"the grammar failed: {error}", True)
        for mask_rows, matcher, drafts in drafted:  # one position after another: serial
            try:
                matcher.masks_along(drafts, [bitmask[row].data_ptr() for row in mask_rows], width * 4)
            except Exception as error:  # noqa: BLE001 - attributed to that request
                failures[matcher.request_id] = RequestError(f"the grammar failed: {error}", True)
        owners = [(row, matcher) for row, matcher in plain] + \
            [(row, matcher) for mask_rows, matcher, _ in drafted for row in mask_rows]
        for row, matcher in owners:
            if matcher.matcher.is_error() and matcher.request_id not in failures:
                failures[matcher.request_id] = RequestError(
                    f"the grammar cannot be followed: {matcher.matcher.get_error()}", True)
            if matcher.request_id in failures:
                bitmask[row] = -1
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return GrammarMask(rows=index, bitmask=bitmask.to(self.device))

    def advance(self, requests: Sequence[Request], token_ids: Sequence[int],
                failures: dict[str, RequestError],
                accepted: Sequence[list[int]] | None = None) -> list[list[int]] | None:
        """Feed each constrained row its verified drafts (``accepted``, speculative
        decoding) and its sampled token; returns the tokens forced after them per row
        (None when no row has any). Forced tokens never take a request past its
        ``max_tokens``, so the scheduler appends all of them unless it stops first.
        A row whose matcher fails is recorded in ``failures`` (its request alone fails)."""
        forced: list[list[int]] | None = None
        started: list[GrammarMatcher] = []
        for row, request in enumerate(requests) if self._waiting else ():
            waiting = self._waiting.get(request.request_id)
            if waiting is None:
                continue
            drafts = accepted[row] if accepted else []
            if _ends_with(request.output_token_ids, [*drafts, token_ids[row]], waiting[0]):  # it starts after these
                del self._waiting[request.request_id]
                waiting[1].num_consumed = request.num_output_tokens + len(drafts) + 1
                started.append(waiting[1])
        for row, matcher in self._constrained(requests):
            request = requests[row]
            if request.request_id in failures:
                continue
            drafts = accepted[row] if accepted else []
            room = request.max_tokens - request.num_output_tokens - 1 - len(drafts)  # after them
            try:
                tokens = matcher.advance(token_ids[row], room, drafts)
            except Exception as error:  # noqa: BLE001 - attributed to that request
                failures[request.request_id] = RequestError(
                    f"the grammar failed: {error}", caused_by_request=matcher.matcher.is_error())
                continue
            if tokens:
                if forced is None:
                    forced = [[] for _ in requests]
                forced[row] = tokens
        for matcher in started:  # from the next step on, as any other
            self._matchers[matcher.request_id] = matcher
        return forced


def _ends_with(output: Sequence[int], new: Sequence[int], trigger: tuple[int, ...]) -> bool:
    """Whether ``output`` followed by ``new`` (the tokens this step adds, its last one
    among them) ends with ``trigger``: just now, as the trigger's last token is the last new one."""
    if not new or new[-1] != trigger[-1]:
        return False
    tail = [*output[max(0, len(output) - len(trigger)):], *new][-len(trigger):]
    return tuple(tail) == trigger
