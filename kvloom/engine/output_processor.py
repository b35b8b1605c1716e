"""Turns a request's tokens into text and outputs: incremental detokenization, stop
strings, logprobs, deltas.

The scheduler's stop check calls ``add_token`` for every token it appends (this is
the ``TokenText`` of engine/stop.py: the text is kept here, the decision is made
there); the engine calls ``make_output`` once per step for each request that moved.
A ``FINAL_ONLY`` request gets no output before it finishes, and where no stop string
needs its text token by token (``SamplingParams.defers_text``) its tokens are
detokenized once, at the end: the same text (IncrementalDetokenizer's invariant), none
of the per-token work on the step.

Invariant: the ``delta_text`` values a caller receives concatenate to exactly the
final ``text``. Text that could still turn into a stop string is held back until it
either completes the stop string (and is dropped) or is ruled out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvloom.batch import LogprobsEntry, PromptLogprobs, TokenPooled
from kvloom.engine.output import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvloom.model_families import PoolerConfig
from kvloom.request import Request, RequestStatus
from kvloom.sampling_params import RequestOutputKind
from kvloom.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class _StreamState:
    detokenizer: IncrementalDetokenizer
    text: str = ""  # final-form text so far (after stop-string truncation)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    # prompt tokens 1, 2, ... as computed (None before prompt_logprobs_start, when a
    # prefix-cache hit served them)
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    prompt_logprobs_out: list[TokenLogprobs | None] | None = None  # converted once complete
    # A pooling request's vector once computed (a token-pooling request's: one per
    # prompt token, gathered chunk by chunk in token_chunks, num_token_vectors rows, until
    # complete).
    pooled: list[float] | list[list[float]] | None = None
    token_chunks: list[torch.Tensor] = field(default_factory=list)
    num_token_vectors: int = 0


def _stopped_by_token(request: Request) -> bool:
    """Whether a finished request ended at a token that stops it by itself (EOS, a stop
    token id), not at a stop string or a length."""
    return request.status is RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, pooler: PoolerConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.pooler = pooler or PoolerConfig()  # how an "embed" request of every token reduces them
        self._streams: dict[Request, _StreamState] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self._streams[request] = _StreamState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                   skip_special_tokens=params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def add_pooled(self, request: Request, vector: list[float]) -> None:
        state = self._streams.get(request)
        if state is not None:
            state.pooled = vector

    def add_token_pooled(self, request: Request, chunk: TokenPooled) -> None:
        """Keep a step's vectors of a token-pooling request; positions already kept (a
        prompt recomputed after preemption) are skipped. Complete at the prompt's end."""
        state = self._streams.get(request)
        if state is None:
            return
        have = state.num_token_vectors
        if chunk.first > have:
            raise AssertionError(f"token vectors of {request.request_id} from position {chunk.first}, "
                                 f"but only {have} are known")
        new_rows = chunk.vectors[have - chunk.first:]
        if len(new_rows):
            state.token_chunks.append(new_rows)
            state.num_token_vectors += len(new_rows)
        if state.num_token_vectors == request.num_prompt_tokens:
            rows = torch.cat(state.token_chunks)
            state.token_chunks = []
            state.pooled = (self._sequence_vector(rows) if request.sampling_params.pooling == "embed"
                            else rows.tolist())

    def _sequence_vector(self, states: torch.Tensor) -> list[float]:
        """An embedding pooled by the mean of the prompt's states ([tokens, hidden] float32)
        or by its first token's (PoolerConfig), L2-normalized unless the pooler says not:
        one reduction over every row in position order, so the bits do not depend on how
        the prompt was chunked."""
        vector = states.mean(dim=0) if self.pooler.seq_pooling == "MEAN" else states[0]
        if self.pooler.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def add_prompt_logprobs(self, request: Request, chunk: PromptLogprobs) -> None:
        """Keep a step's prompt logprobs; positions already kept (a prompt recomputed
        after preemption) are skipped."""
        state = self._streams.get(request)
        if state is None or state.prompt_logprobs is None:
            return
        have = len(state.prompt_logprobs)  # positions 1 .. have
        skip = have + 1 - chunk.first
        if skip < 0 and chunk.first <= request.sampling_params.prompt_logprobs_start:
            state.prompt_logprobs.extend([None] * -skip)  # not asked for: a cache hit served them
            skip = 0
        if skip < 0:
            raise AssertionError(f"prompt logprobs of {request.request_id} from position {chunk.first}, "
                                 f"but only {have} are known")
        state.prompt_logprobs.extend(chunk.entries[skip:])

    def discard(self, request: Request) -> None:
        self._streams.pop(request, None)

    def add_token(self, request: Request, token_id: int) -> str | None:
        """Detokenize the request's newest token; returns the stop string it completed
        (the text is cut there, or after it with ``include_stop_str_in_output``)."""
        state = self._streams[request]
        params = request.sampling_params
        if params.defers_text:  # detokenized when it finishes (make_output)
            return None
        previous_len = len(state.text)
        state.text += state.detokenizer.add_tokens([token_id])
        for stop in params.stop:
            index = state.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                state.text = state.text[:end]
                return stop
        return None

    def _convert_logprobs(self, entry: LogprobsEntry) -> TokenLogprobs:
        result: TokenLogprobs = {}
        sampled_id, sampled_logprob, sampled_rank = entry.token_id, entry.logprob, entry.rank
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs, start=1):
            result[token_id] = Logprob(logprob, rank, self.tokenizer.decode([token_id], skip_special_tokens=False))
        if sampled_id not in result:
            result[sampled_id] = Logprob(sampled_logprob, sampled_rank,
                                         self.tokenizer.decode([sampled_id], skip_special_tokens=False))
        # The sampled token first, as vLLM orders it.
        return {sampled_id: result.pop(sampled_id), **result}

    def _prompt_logprobs(self, state: _StreamState, request: Request) -> list[TokenLogprobs | None] | None:
        """Complete once every prompt position is known (a prompt of P tokens has P - 1)."""
        if state.prompt_logprobs_out is None and state.prompt_logprobs is not None \
                and len(state.prompt_logprobs) >= request.num_prompt_tokens - 1:
            state.prompt_logprobs_out = [None, *(None if entry is None else self._convert_logprobs(entry)
                                                 for entry in state.prompt_logprobs)]
        return state.prompt_logprobs_out

    def make_output(self, request: Request,
                    new_logprobs: Sequence[LogprobsEntry | None] = ()) -> RequestOutput | None:
        """The request's output for what it did since the previous call, as its
        ``output_kind`` asks (CUMULATIVE: everything so far, with the deltas; DELTA: the
        deltas only), or None for a ``FINAL_ONLY`` request that has not finished.
        ``new_logprobs``: those of the tokens appended since then, where requested (kept
        in every case)."""
        state = self._streams[request]
        if state.logprobs is not None:
            state.logprobs.extend(self._convert_logprobs(entry) for entry in new_logprobs if entry is not None)
        finished = request.is_finished
        kind = request.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished and request.sampling_params.defers_text:  # no token was detokenized yet
            tokens = request.output_token_ids
            if _stopped_by_token(request) and not request.sampling_params.include_stop_str_in_output:
                tokens = tokens[:-1]  # as StopChecker.check: the stop token's text is not output
            state.text += state.detokenizer.add_tokens(tokens)
        if finished and not isinstance(request.stop_reason, str):
            # Bytes of an unfinished character are released at the very end.
            state.text += state.detokenizer.finish()
        visible = len(state.text)
        if not finished and request.sampling_params.stop:
            visible -= _held_back(state.text, request.sampling_params.stop)
        visible = max(visible, state.num_sent_chars)
        delta_text = state.text[state.num_sent_chars:visible]
        state.num_sent_chars = visible
        tokens = request.output_token_ids
        delta_tokens = tokens[state.num_sent_tokens:]
        delta_logprobs = None
        if state.logprobs is not None:
            delta_logprobs = state.logprobs[state.num_sent_tokens:]
        state.num_sent_tokens = len(tokens)
        text = state.text if finished else state.text[:visible]
        delta = kind is RequestOutputKind.DELTA
        completion = CompletionOutput(
            index=0,
            text=delta_text if delta else text,
            token_ids=list(delta_tokens if delta else tokens),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            logprobs=(delta_logprobs if delta else list(state.logprobs)) if state.logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
        )
        if finished:
            self.discard(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            cache_miss_reason=request.cache_miss_reason,
            metrics=request.timeline,
            error=request.error,
            prompt_logprobs=self._prompt_logprobs(state, request),
            pooled=state.pooled,
        )
