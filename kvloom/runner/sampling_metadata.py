"""Per-step sampling inputs: one row per sequence, turned into batch tensors once.

The runner builds a ``SamplingRequestState`` for each row it wants a token for and
calls ``SamplingMetadata.build``; the sampler only reads the resulting tensors.
Everything a step does not need is ``None`` (no penalty rows -> no ``[B, V]``
count tensors; no top-k rows -> no top-k tensor), so the sampler skips that work
by checking for ``None`` instead of inspecting values on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.runner.device import host_values_to
from kvloom.sampling_params import SamplingParams, seed_value
from kvloom.structured.mask import GrammarMask


@dataclass(slots=True)
class SamplingRequestState:
    """One row's sampling inputs, built by the runner from a request.

    ``generator`` must be set exactly when the row is random and ``params.seed`` is
    set (see ``generator_for_seed``); it is owned by the request and advances every
    step, which is what makes a seeded request reproducible on its own.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]


def generator_for_seed(seed: int, device: torch.device) -> torch.Generator:
    """A fresh generator on ``device`` for a request with ``SamplingParams.seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed_value(seed))  # validated to 64 bits by SamplingParams
    return generator


@dataclass(slots=True)
class PenaltyTensors:
    """Penalty inputs for the P rows that use any penalty (other rows are untouched)."""

    rows: torch.Tensor  # [P] int64, batch rows these tensors describe
    repetition: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    output_counts: torch.Tensor  # [P, V] float32, occurrences of each token in the output
    seen_in_prompt_or_output: torch.Tensor  # [P, V] bool, scope of the repetition penalty


@dataclass(slots=True)
class SamplingMetadata:
    """Batch tensors for one sampler call over B rows and a vocabulary of V.

    Rows split into greedy (argmax after penalties and min_tokens) and random
    rows; the per-row knobs that only random rows use (temperature, top-k, top-p,
    min-p, generators) are indexed by position among the random rows, R of them.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_rows: torch.Tensor  # [G] int64 batch rows
    random_rows: torch.Tensor  # [R] int64 batch rows
    temperature: torch.Tensor | None  # [R, 1] float32; None when R == 0
    # [R] int64 in [1, V]; disabled rows hold V. None when no random row uses top-k.
    top_k: torch.Tensor | None
    max_top_k: int  # largest k below V among top-k rows (V when there are none)
    top_p: torch.Tensor | None  # [R] float32; None when no random row uses top-p
    min_p: torch.Tensor | None  # [R] float32; None when no random row uses min-p
    # (position among random rows, generator) for seeded random rows.
    seeded: list[tuple[int, torch.Generator]]
    unseeded: torch.Tensor | None  # [U] int64 positions among random rows; None when U == 0
    penalties: PenaltyTensors | None
    # Tokens forced to -inf: stop tokens of a row that has not reached min_tokens yet, and
    # the tokens that would complete one of a row's bad words. Pairs of (batch row, token
    # id), N of them; None when no row blocks any.
    blocked_rows: torch.Tensor | None  # [N] int64
    blocked_token_ids: torch.Tensor | None  # [N] int64
    # allowed_token_ids: the A rows that have them, and which tokens each may take (the
    # others become -inf). None when no row restricts its tokens.
    allowed_rows: torch.Tensor | None  # [A] int64
    allowed_mask: torch.Tensor | None  # [A, V] bool
    # logit_bias as M (batch row, token id, bias) triples; None when no row has one.
    bias_rows: torch.Tensor | None  # [M] int64
    bias_token_ids: torch.Tensor | None  # [M] int64
    bias_values: torch.Tensor | None  # [M] float32
    logprob_rows: torch.Tensor | None  # [L] int64 batch rows that asked for logprobs
    num_logprobs: list[int]  # [L] top-n size per logprob row
    max_num_logprobs: int
    grammar: GrammarMask | None = None  # None when no row is constrained
    # Thinking budgets run out: F rows that must take one token (their reasoning's end
    # marker), every other token -inf, after all the stages above. None when none must.
    forced_rows: torch.Tensor | None = None  # [F] int64
    forced_token_ids: torch.Tensor | None = None  # [F] int64

    @classmethod
    def build(
        cls, rows: list[SamplingRequestState], vocab_size: int, device: torch.device,
        grammar: GrammarMask | None = None,
    ) -> SamplingMetadata:
        """Collect the rows' parameters into tensors on ``device`` (one copy each).

        ``grammar`` (built by the runner's structured output manager) is passed through.
        """
        if not rows:
            raise ValueError("rows must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        def index_tensor(values: list[int]) -> torch.Tensor:
            return host_values_to(values, torch.int64, device)

        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        random_params = [rows[i].params for i in random]

        seeded: list[tuple[int, torch.Generator]] = []
        unseeded: list[int] = []
        for position, batch_row in enumerate(random):
            row = rows[batch_row]
            if row.params.seed is None:
                unseeded.append(position)
            elif row.generator is None:
                # Falling back to the shared generator would silently lose reproducibility.
                raise ValueError(f"row {batch_row} has seed={row.params.seed} but no generator")
            else:
                seeded.append((position, row.generator))

        top_k_values = [_effective_top_k(p.top_k, vocab_size) for p in random_params]
        uses_top_k = any(k < vocab_size for k in top_k_values)
        uses_top_p = any(p.top_p < 1.0 for p in random_params)
        uses_min_p = any(p.min_p > 0.0 for p in random_params)

        def float_tensor(values: list[float]) -> torch.Tensor:
            return host_values_to(values, torch.float32, device)

        blocked_rows, blocked_token_ids = _min_tokens_blocks(rows, vocab_size)
        bad_rows, bad_token_ids = _bad_word_blocks(rows, vocab_size)
        blocked_rows, blocked_token_ids = blocked_rows + bad_rows, blocked_token_ids + bad_token_ids
        allowed_rows = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
        bias_rows, bias_token_ids, bias_values = _logit_bias_triples(rows, vocab_size)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        num_logprobs = [rows[i].params.logprobs or 0 for i in logprob_rows]
        forced = [(i, token) for i, row in enumerate(rows) if row.params.thinking_budget is not None
                  and (token := row.params.thinking_budget.forced(row.output_token_ids)) is not None
                  and token < vocab_size]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=not random,
            all_random=not greedy,
            greedy_rows=index_tensor(greedy),
            random_rows=index_tensor(random),
            temperature=(
                float_tensor([p.temperature for p in random_params]).unsqueeze(1)
                if random
                else None
            ),  # [R, 1] so it broadcasts over the vocabulary
            top_k=index_tensor(top_k_values) if uses_top_k else None,
            # Largest k among rows that use top-k: the top-k-only path fetches this many.
            max_top_k=max((k for k in top_k_values if k < vocab_size), default=vocab_size),
            top_p=float_tensor([p.top_p for p in random_params]) if uses_top_p else None,
            min_p=float_tensor([p.min_p for p in random_params]) if uses_min_p else None,
            seeded=seeded,
            unseeded=index_tensor(unseeded) if unseeded else None,
            penalties=_penalty_tensors(rows, vocab_size, device),
            blocked_rows=index_tensor(blocked_rows) if blocked_rows else None,
            blocked_token_ids=index_tensor(blocked_token_ids) if blocked_rows else None,
            allowed_rows=index_tensor(allowed_rows) if allowed_rows else None,
            allowed_mask=_allowed_mask(rows, allowed_rows, vocab_size, device) if allowed_rows else None,
            bias_rows=index_tensor(bias_rows) if bias_rows else None,
            bias_token_ids=index_tensor(bias_token_ids) if bias_rows else None,
            bias_values=float_tensor(bias_values) if bias_rows else None,
            logprob_rows=index_tensor(logprob_rows) if logprob_rows else None,
            num_logprobs=num_logprobs,
            max_num_logprobs=min(max(num_logprobs, default=0), vocab_size),
            grammar=grammar,
            forced_rows=index_tensor([i for i, _ in forced]) if forced else None,
            forced_token_ids=index_tensor([token for _, token in forced]) if forced else None,
        )


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    # 0 and -1 mean "disabled", which is the same as keeping the whole vocabulary.
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _min_tokens_blocks(
    rows: list[SamplingRequestState], vocab_size: int
) -> tuple[list[int], list[int]]:
    """(row, token) pairs to forbid: stop tokens of rows still short of min_tokens.

    EOS is only blocked without ``ignore_eos``: with it the engine does not stop on
    EOS, so EOS is an ordinary token. Ids outside the logits' vocabulary (tokenizer
    and model sizes can differ) cannot be sampled anyway and are skipped. Rows with
    structured output are skipped: their grammar decides where the output ends, and
    blocking EOS where the grammar allows only EOS would leave no token to sample.
    """
    blocked_rows: list[int] = []
    blocked_token_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens or row.params.structured is not None:
            continue
        stop_ids = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            stop_ids.update(row.eos_token_ids)
        for token_id in sorted(t for t in stop_ids if 0 <= t < vocab_size):
            blocked_rows.append(i)
            blocked_token_ids.append(token_id)
    return blocked_rows, blocked_token_ids


def _bad_word_blocks(rows: list[SamplingRequestState], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to forbid: the last token of each of a row's bad words whose
    other tokens end its output so far (a one-token word's, always). vLLM's rule: only
    the output counts, not the prompt."""
    blocked_rows: list[int] = []
    blocked_token_ids: list[int] = []
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        output = row.output_token_ids
        banned = {word[-1] for word in words
                  if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]}
        for token_id in sorted(t for t in banned if t < vocab_size):
            blocked_rows.append(i)
            blocked_token_ids.append(token_id)
    return blocked_rows, blocked_token_ids


def _allowed_mask(rows: list[SamplingRequestState], allowed_rows: list[int], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """[A, V] bool: True where allowed row a may take the token (ids past the logits'
    vocabulary are left out, as logit_bias's)."""
    mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
    for position, i in enumerate(allowed_rows):
        ids = [t for t in rows[i].params.allowed_token_ids or () if t < vocab_size]
        mask[position, ids] = True
    return mask.to(device)


def _logit_bias_triples(
    rows: list[SamplingRequestState], vocab_size: int
) -> tuple[list[int], list[int], list[float]]:
    """(row, token, bias) for every logit_bias entry; ids outside the logits' vocabulary
    (admission already refused ids outside the model's) are skipped like min_tokens'."""
    bias_rows: list[int] = []
    bias_token_ids: list[int] = []
    bias_values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in sorted((row.params.logit_bias or {}).items()):
            if 0 <= token_id < vocab_size:
                bias_rows.append(i)
                bias_token_ids.append(token_id)
                bias_values.append(bias)
    return bias_rows, bias_token_ids, bias_values


def _penalty_tensors(
    rows: list[SamplingRequestState], vocab_size: int, device: torch.device
) -> PenaltyTensors | None:
    """Dense per-token counts for the rows with penalties, or None if no row has any.

    Counts are rebuilt from the token lists each step: O(prompt + output) host work
    per penalty row, which is simple and stateless; an incremental per-request
    count tensor is the upgrade if this shows up in profiles.
    """
    penalty_rows = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not penalty_rows:
        return None
    outputs = [rows[i].output_token_ids for i in penalty_rows]
    prompts = [rows[i].prompt_token_ids for i in penalty_rows]
    output_counts = _token_counts(outputs, vocab_size, device)  # [P, V]
    prompt_counts = _token_counts(prompts, vocab_size, device)  # [P, V]
    params = [rows[i].params for i in penalty_rows]

    def column(values: list[float]) -> torch.Tensor:
        return host_values_to(values, torch.float32, device).unsqueeze(1)  # [P, 1]

    return PenaltyTensors(
        rows=host_values_to(penalty_rows, torch.int64, device),
        repetition=column([p.repetition_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        output_counts=output_counts,
        seen_in_prompt_or_output=(output_counts > 0) | (prompt_counts > 0),
    )


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), V] float32 occurrence counts, built with one scatter_add."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Padding (and any id outside the vocabulary) lands in an extra trash column V.
    padded = [
        [t if 0 <= t < vocab_size else vocab_size for t in tokens]
        + [vocab_size] * (width - len(tokens))
        for tokens in token_lists
    ]
    index = host_values_to(padded, torch.int64, device).reshape(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]  # [P, V], trash column dropped
