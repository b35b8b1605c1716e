"""The objects that cross the step's inner boundaries.

scheduler -> runner: a ``SchedulerOutput`` of ``ScheduledRequest`` snapshots (which
tokens of which request to compute this step). runner -> model and attention: the
``ForwardBatch`` tensors built from it. runner -> scheduler: the ``RunnerOutput``
(sampled and forced tokens, logprobs, per-request failures) that
``Scheduler.update`` turns into request state. Both sides of each boundary import
this module; it imports nothing above ``request``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvloom.request import NO_BLOCK, Request, RequestError


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``.

    A snapshot taken when the step is scheduled: ``samples`` and ``is_prefill`` keep
    their values after ``Scheduler.update`` has moved the request on. The runner
    samples a token only where ``samples`` (the chunk reaches the last known token).

    ``draft_token_ids`` (speculative decoding) are proposed tokens that follow the
    request's known tokens: they are the last ``len(draft_token_ids)`` of the
    ``num_new_tokens`` computed, and the runner samples at each of them too (the
    verification chunk); they are not the request's tokens until verified.
    """

    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_new_tokens: int  # known tokens + drafts
    samples: bool
    is_prefill: bool  # computes prompt, recomputed or forced tokens, not one decode token
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, start: int, num_new_tokens: int,
           draft_token_ids: tuple[int, ...] = ()) -> ScheduledRequest:
        num_known = num_new_tokens - len(draft_token_ids)
        samples = start + num_known == request.num_tokens_with_pending
        if draft_token_ids and not samples:
            raise ValueError(f"drafts for {request.request_id} must follow its last known token")
        is_decode = (num_known == 1 and samples
                     and request.num_output_tokens + request.num_pending_tokens > 0)
        return cls(request, start, num_new_tokens, samples, not is_decode, draft_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens of the request itself (not drafts) this step computes."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Positions the runner samples at: the last known token and every draft."""
        return (1 + len(self.draft_token_ids)) if self.samples else 0


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy a state-space model's state (every mixer layer's) from slot ``src`` to ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy KV block ``src`` whole into block ``dst``, in every layer: a prefix hit that
    ends inside cached block ``src`` starts its request's first private block ``dst``
    as that block (cache/kv_manager.py). Whole blocks, so that no caller needs the
    order of the slots inside one (the attention backend's); the slots past the hit
    are overwritten by the request before anything reads them."""

    src: int
    dst: int


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward pass, and nothing else."""

    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)
    # State-space models with prefix caching (cache/kv_manager.py): before the forward,
    # a hit's checkpoint into its request's slot; after it, a request's slot into a
    # checkpoint (its chunk ended at a planned checkpoint).
    state_restores: list[StateCopy] = field(default_factory=list)
    state_saves: list[StateCopy] = field(default_factory=list)
    # Before the forward: the partial blocks of this step's prefix hits.
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ForwardBatch:
    """The tensors of one step, built from a SchedulerOutput.

    Tokens of all scheduled requests are packed into one flat sequence (no padding);
    ``query_start_loc`` marks where each request's tokens start. Python-side copies of
    the lengths are kept so that backends can loop without device->host syncs.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length once this step's tokens are in
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    # [num_rows] int64: the last known token of each sampling request, then its drafts
    logits_indices: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    # [num_seqs] int64: each request's state slot (cache/state_pool.py); None for a model
    # without state-space layers
    state_slots: torch.Tensor | None = None
    # Overlap scheduling: input_ids[placeholder_positions[i]] is the token the previous
    # step sampled in its row placeholder_rows[i], still on the device (0 here until
    # the runner fills it in); None when every input token is known.
    placeholder_positions: torch.Tensor | None = None
    placeholder_rows: torch.Tensor | None = None
    # [2, num_copies] int64: source blocks, then destination blocks, to be copied before
    # the forward (SchedulerOutput.block_copies); None when there are none.
    block_copies: torch.Tensor | None = None
    # The rows whose final hidden states the step reads, when that is not all of them:
    # the sampled rows (logits_indices), where some rows are not sampled (a prompt's
    # chunk samples at its last row at most) and no chunk asks for prompt logprobs. The
    # forward then returns these rows alone, and a model may skip the rest of its last
    # layer for the others (every row's K and V are still written). None: every row.
    output_rows: torch.Tensor | None = None
    # LoRA (kvloom/lora): each sequence's adapter slot, -1 for the base model; None when
    # no sequence runs an adapter. The rows it reads (output_rows) are
    # the step's as for any other.
    lora_slots: list[int] | None = None
    # LongRoPE (Request.long_rope): each sequence's "its prompt is past the original
    # context, every token turns by the long factors"; None when no sequence's is.
    long_rope: list[bool] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @classmethod
    def build(cls, output: SchedulerOutput, block_size: int, device: torch.device,
              pending_rows: Mapping[str, int] | None = None,
              lora_slots: Mapping[str, int] | None = None) -> ForwardBatch:
        """``pending_rows``: for each request with a pending token (overlap scheduling),
        its row among the previous step's sampled tokens; ``lora_slots``: the LoRA slot
        of each request that runs an adapter."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        every_row = False  # some chunk's prompt logprobs read every row's final state
        state_slots: list[int] = []
        placeholders: list[int] = []
        placeholder_rows: list[int] = []
        seq_lora = [lora_slots.get(item.request.request_id, -1) for item in output.scheduled] if lora_slots else []
        with_lora = any(slot >= 0 for slot in seq_lora)
        long_rope = [item.request.long_rope for item in output.scheduled]
        for item in output.scheduled:
            request, start, count = item.request, item.start, item.num_new_tokens
            end = start + count
            block_ids = request.block_ids
            input_ids.extend(request.all_token_ids[start:start + item.num_known_tokens])
            if start + item.num_known_tokens > request.num_tokens:  # it computes its pending token
                assert pending_rows is not None and request.num_pending_tokens == 1, request
                placeholders.append(len(input_ids))
                placeholder_rows.append(pending_rows[request.request_id])
                input_ids.append(0)
            input_ids.extend(item.draft_token_ids)
            positions.extend(range(start, end))
            slots.extend(block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            query_lens.append(count)
            seq_lens.append(end)
            if item.samples:
                logits_indices.extend(range(len(input_ids) - item.num_sampled_rows, len(input_ids)))
            every_row = every_row or request.sampling_params.prompt_logprobs is not None or request.pools_every_token
            table = block_ids[: -(-end // block_size)]
            if table[0] == NO_BLOCK:  # let go behind a sliding window: no kernel reads it
                table = [max(b, 0) for b in table]
            tables.append(table)
            if request.state_slot is not None:
                state_slots.append(request.state_slot)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)

        # Every field goes to the device in two copies (its int64 and its int32 fields,
        # each packed into one buffer, pinned on CUDA so the copy is asynchronous), then
        # the fields are views of those buffers.
        copies = [c.src for c in output.block_copies] + [c.dst for c in output.block_copies]
        wide = _to_device([input_ids, positions, slots, logits_indices, state_slots, placeholders,
                           placeholder_rows, copies], torch.int64, device)
        narrow = _to_device([[b for t in padded for b in t], seq_lens, starts], torch.int32, device)
        return cls(
            input_ids=wide[0],
            positions=wide[1],
            slot_mapping=wide[2],
            block_tables=narrow[0].view(len(padded), max_blocks),
            seq_lens=narrow[1],
            query_start_loc=narrow[2],
            logits_indices=wide[3],
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            block_size=block_size,
            state_slots=wide[4] if state_slots else None,
            placeholder_positions=wide[5] if placeholders else None,
            placeholder_rows=wide[6] if placeholders else None,
            block_copies=wide[7].view(2, -1) if copies else None,
            output_rows=None if every_row or len(logits_indices) == len(input_ids) else wide[3],
            lora_slots=seq_lora if with_lora else None,
            long_rope=long_rope if any(long_rope) else None,
        )

    def final_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """A forward's result: ``hidden`` ([tokens, hidden], every row's final state)
        narrowed to the rows the step reads (``output_rows``) where it names them."""
        return hidden if self.output_rows is None else hidden[self.output_rows]


def _to_device(fields: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``fields`` as tensors on ``device`` from one host buffer and one copy."""
    host = torch.tensor([value for field_values in fields for value in field_values], dtype=dtype,
                        pin_memory=device.type == "cuda")
    packed = host.to(device, non_blocking=True)
    return list(torch.split(packed, [len(field_values) for field_values in fields]))


@dataclass(slots=True)
class LogprobsEntry:
    """Log-probabilities reported for one sampled token."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits
    rank: int  # 1-based: 1 + number of tokens with a strictly greater logprob
    top_logprobs: list[tuple[int, float]]  # the n best (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The logprobs of prompt tokens ``[first, first + len(entries))`` that one step's
    chunk computed: entry i is prompt token ``first + i`` under the tokens before it."""

    first: int
    entries: list[LogprobsEntry]


@dataclass(slots=True)
class TokenPooled:
    """The vectors of prompt positions ``[first, first + len(vectors))`` that one step's
    chunk computed for a token-pooling request (SamplingParams.pooling "token_embed" or
    "token_classify"): row i is position ``first + i``'s. Kept as one host tensor, so a
    mean embedding reduces its rows without a round trip through Python lists."""

    first: int
    vectors: torch.Tensor  # [count, width] float32, on the host


@dataclass(slots=True)
class RunnerOutput:
    """What one forward pass produced, aligned with ``SchedulerOutput.scheduled``."""

    sampled: list[int | None]  # None where the entry samples nothing (a mid-prompt chunk)
    logprobs: list[LogprobsEntry | None]  # where the request asked for logprobs
    # Tokens a grammar forces after each entry's sampled token (jump-forward); None when
    # no entry has any (the common case).
    forced: list[list[int]] | None = None
    # Requests whose own per-request work failed this step (their grammar, ...): each
    # fails alone and its entries above are ignored.
    failed: dict[str, RequestError] = field(default_factory=dict)
    # By request id, for requests with SamplingParams.prompt_logprobs whose chunk this was.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: each entry's verified drafts (the longest prefix of its
    # draft_token_ids that the target's own samples reproduce), which come before
    # ``sampled``, and their logprobs; None when no entry had drafts.
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[LogprobsEntry | None]] | None = None
    # By request id, for pooling requests (SamplingParams.pooling) that sampled this step:
    # what they read at their prompt's last token (the normalized final hidden state, or
    # a classifier's class logits).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # By request id, for token-pooling requests whose chunk this was.
    token_pooled: dict[str, TokenPooled] = field(default_factory=dict)

    def num_accepted(self, index: int) -> int:
        return len(self.accepted[index]) if self.accepted else 0

    def new_token_ids(self, index: int) -> list[int]:
        """Entry ``index``'s accepted drafts, its sampled token, then its forced tokens."""
        token_id = self.sampled[index]
        if token_id is None:
            return []
        accepted = self.accepted[index] if self.accepted else ()
        return [*accepted, token_id, *(self.forced[index] if self.forced else ())]

    def new_logprobs(self, index: int) -> list[LogprobsEntry | None]:
        """The logprobs of ``new_token_ids(index)``, one per token. A forced token was
        certain under the grammar: it reports logprob 0.0 and rank 1."""
        token_ids, entry = self.new_token_ids(index), self.logprobs[index]
        if entry is None or not token_ids:
            return [None] * len(token_ids)
        accepted = self.accepted_logprobs[index] if self.accepted_logprobs else []
        forced = token_ids[len(accepted) + 1:]
        return [*accepted, entry, *(LogprobsEntry(forced_id, 0.0, 1, [(forced_id, 0.0)] if entry.top_logprobs else [])
                                    for forced_id in forced)]
