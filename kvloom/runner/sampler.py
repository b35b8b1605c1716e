"""Batched token sampling on tensors (CPU or CUDA: the logits' device is used throughout).

Pipeline, vLLM-compatible, each stage skipped when no row needs it:

1. penalties (repetition, then frequency, then presence), on the penalty rows only;
1b. logit_bias: each row's biases added to its logits (OpenAI: greedy rows too);
1c. allowed_token_ids: every other token of such a row becomes -inf;
2. min_tokens and bad words: stop tokens of rows still short of ``min_tokens``, and the
   tokens that would complete a bad word, become -inf;
3. grammar: tokens a constrained row's grammar forbids become -inf (structured output);
3b. thinking budget: a row whose reasoning has run out of tokens takes its end marker
   (every other token -inf), whatever the stages before left;
4. greedy rows take the argmax here and never consume randomness;
5. random rows: temperature -> top-k -> top-p -> min-p -> softmax -> inverse-CDF draw (one uniform per row).
   On CPU the softmax and the draw are one C++ pass per row (``kvloom/csrc/sampling.cpp``,
   with the temperature folded in when no filter runs); the PyTorch chain is the
   reference, used on other devices and where the C++ source does not build.

Logprobs are computed from the raw logits handed to the sampler (``log_softmax``
before penalties, min_tokens and temperature), i.e. what the model believes, not
what the sampling knobs reshaped; this matches vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvloom.batch import LogprobsEntry
from kvloom.kernels import sampling
from kvloom.runner.device import HostCopy
from kvloom.runner.sampling_metadata import PenaltyTensors, SamplingMetadata
from kvloom.structured.mask import GrammarMask


@functools.cache  # asked once: whether csrc/sampling.cpp builds here
def native_sampling() -> bool:
    """Whether the one-pass C++ draw (``kvloom::sample_rows``) runs here; else the
    PyTorch chain does."""
    return sampling.available()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` -> ``[B]`` int64, the first maximum of each row (torch.argmax's rule):
    on CPU the one-pass native kernel, which reads bf16 logits as they are."""
    if logits.device.type == "cpu" and native_sampling() and logits.dtype in (torch.float32, torch.bfloat16):
        return sampling.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def sample_rows_native(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ~ softmax(logits * inv_temperature) per row, drawn by inverse CDF with the
    row's uniform: ``Sampler._inverse_cdf`` of that softmax, in one pass per row."""
    logits = logits.float().contiguous()  # [R, V]
    inv_temperature = inv_temperature.float().flatten().contiguous()  # [R]
    uniforms = uniforms.float().contiguous()  # [R]
    return sampling.sample_rows(logits, inv_temperature, uniforms)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and logprobs for rows whose params asked for them."""

    token_ids: list[int]  # [B]
    logprobs: list[LogprobsEntry | None]  # [B]; None where params.logprobs is None


@dataclass(slots=True)
class DeviceSample:
    """A step's samples as the device left them, on their way to the host: the copy is
    queued behind the sampling, so the host can go on (and queue the next step) until
    it needs the values."""

    token_ids: torch.Tensor  # [B] int64 on the logits' device: the next step's placeholders read it
    _host: HostCopy
    _metadata: SamplingMetadata

    def result(self) -> SamplerOutput:
        """The samples on the host; waits for the device (up to this step only)."""
        token_ids, *logprobs = self._host.wait()
        return SamplerOutput(token_ids.tolist(), logprob_entries(logprobs, self._metadata))


class Sampler:
    """Samples one token per row from ``[B, V]`` logits under a ``SamplingMetadata``."""

    def __init__(self, default_generator: torch.Generator) -> None:
        # Shared by all unseeded random rows; it must live on the logits' device.
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample ``[B]`` tokens; ``logits`` (any float dtype) is never modified."""
        return self.sample(logits, metadata).result()

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> DeviceSample:
        """``__call__`` without waiting for the device: no synchronisation before the
        host reads the result."""
        expected = (metadata.num_rows, metadata.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise ValueError(f"logits must have shape {expected}, got {tuple(logits.shape)}")
        processing = (metadata.penalties is not None or metadata.bias_rows is not None
                      or metadata.allowed_rows is not None or metadata.blocked_rows is not None
                      or metadata.grammar is not None or metadata.forced_rows is not None)
        if metadata.all_greedy and metadata.logprob_rows is None and (not processing or masks_only(metadata)):
            if processing:  # a grammar's -inf (and forced tokens) in the model's dtype: the same argmax
                logits = apply_forced_tokens(apply_token_bitmask(logits.clone(), metadata.grammar)
                                             if metadata.grammar is not None else logits.clone(), metadata)
            token_ids = argmax(logits)  # straight from the model's logits, in their dtype
            return DeviceSample(token_ids, HostCopy([token_ids]), metadata)
        raw_logits = logits.float()  # [B, V]; no copy when already float32
        processed = raw_logits
        if processing:
            # The stages below write in place; raw_logits must survive for logprobs.
            processed = raw_logits.clone()
            if metadata.penalties is not None:
                apply_penalties(processed, metadata.penalties)
            apply_logit_bias(processed, metadata)
            apply_allowed_tokens(processed, metadata)
            apply_blocked_tokens(processed, metadata)
            if metadata.grammar is not None:
                apply_token_bitmask(processed, metadata.grammar)
            apply_forced_tokens(processed, metadata)
        token_ids = self._sample(processed, metadata)  # [B] int64
        logprobs = logprob_tensors(raw_logits, token_ids, metadata)
        return DeviceSample(token_ids, HostCopy([token_ids, *logprobs]), metadata)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return argmax(logits)
        random_logits = logits if metadata.all_random else logits[metadata.random_rows]
        random_tokens = self._sample_random(random_logits, metadata)  # [R]
        if metadata.all_random:
            return random_tokens
        tokens = torch.empty(metadata.num_rows, dtype=torch.int64, device=logits.device)
        tokens[metadata.greedy_rows] = argmax(logits[metadata.greedy_rows])
        tokens[metadata.random_rows] = random_tokens
        return tokens

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``[R, V]`` logits of the random rows -> ``[R]`` sampled tokens."""
        assert metadata.temperature is not None  # set whenever there are random rows
        uniforms = self._uniforms(logits, metadata)  # [R]; filters consume no randomness
        filtered = metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None
        fused = logits.device.type == "cpu" and native_sampling()
        if fused and not filtered:  # temperature folded into the one pass
            return sample_rows_native(logits, 1.0 / metadata.temperature, uniforms)
        # Out of place: from here on every stage owns and may overwrite `scaled`.
        scaled = logits / metadata.temperature  # [R, V]
        if metadata.top_k is not None or metadata.top_p is not None:
            apply_top_k_top_p(scaled, metadata.top_k, metadata.max_top_k, metadata.top_p)
        if metadata.min_p is not None:
            apply_min_p(scaled, metadata.min_p)
        if fused:
            return sample_rows_native(scaled, torch.ones_like(uniforms), uniforms)
        probs = torch.softmax(scaled, dim=-1)  # [R, V]
        return self._inverse_cdf(probs, uniforms)

    @staticmethod
    def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Categorical(p) by inverse CDF: one uniform per row, so the cost is a cumsum and
        a binary search instead of a random number per vocabulary entry (on CPU, drawing
        [R, V] exponentials for the Gumbel race costs more than the model's lm_head)."""
        cdf = probs.cumsum(dim=-1)  # [R, V]
        targets = uniforms.unsqueeze(1) * cdf[:, -1:]  # [R, 1]
        tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # [R]
        # Rounding can put a target at or past the total; never pick a token with zero
        # probability (filtered out) because of it: cap at the last token that has mass.
        vocab = probs.shape[1]
        last_nonzero = vocab - 1 - (probs > 0).flip(dims=[1]).to(torch.int8).argmax(dim=1)  # [R]
        return torch.minimum(tokens, last_nonzero)

    def _uniforms(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One U[0, 1) per row; seeded rows draw from their own generator.

        A seeded row's draw depends only on its generator's state, never on the
        batch's size or its position, so the same seed gives the same tokens.
        """
        uniforms = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)  # [R]
        if metadata.unseeded is not None:
            if not metadata.seeded:
                uniforms.uniform_(generator=self.default_generator)
            else:
                shared = torch.empty(len(metadata.unseeded), dtype=logits.dtype, device=logits.device)
                uniforms[metadata.unseeded] = shared.uniform_(generator=self.default_generator)
        for position, generator in metadata.seeded:
            uniforms[position : position + 1].uniform_(generator=generator)
        return uniforms


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """In place on ``[B, V]`` logits; rows without penalties are not touched.

    Repetition (CTRL): for tokens seen in prompt or output, divide positive logits
    by the penalty and multiply negative ones. Frequency (OpenAI): subtract
    penalty * count in the output. Presence (OpenAI): subtract the penalty once
    for each token that appears in the output.
    """
    rows = logits[penalties.rows]  # [P, V] copy
    repeated = torch.where(rows > 0, rows / penalties.repetition, rows * penalties.repetition)
    rows = torch.where(penalties.seen_in_prompt_or_output, repeated, rows)
    rows -= penalties.frequency * penalties.output_counts
    rows -= penalties.presence * (penalties.output_counts > 0).to(rows.dtype)
    logits[penalties.rows] = rows
    return logits


def apply_allowed_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: -inf for every token a row with allowed_token_ids may not take."""
    if metadata.allowed_rows is not None and metadata.allowed_mask is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill(~metadata.allowed_mask, float("-inf"))
    return logits


def masks_only(metadata: SamplingMetadata) -> bool:
    """Whether the processing stages only forbid tokens (a grammar) or force them (a
    thinking budget): they change no value that survives, so a greedy batch may apply them
    to the logits in the model's dtype instead of a float32 copy."""
    return (metadata.penalties is None and metadata.bias_rows is None and metadata.allowed_rows is None
            and metadata.blocked_rows is None)


def apply_forced_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: a forced row's token gets 0, every other token of the row -inf (so a
    greedy row's argmax and a random row's draw both give it)."""
    if metadata.forced_rows is not None:
        assert metadata.forced_token_ids is not None
        logits[metadata.forced_rows] = float("-inf")
        logits[metadata.forced_rows, metadata.forced_token_ids] = 0.0
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: add each (row, token) bias; (row, token) pairs are unique per step."""
    if metadata.bias_rows is not None:
        assert metadata.bias_token_ids is not None and metadata.bias_values is not None
        logits.index_put_((metadata.bias_rows, metadata.bias_token_ids), metadata.bias_values,
                          accumulate=True)
    return logits


def apply_blocked_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: forbid each row's blocked tokens, its stop tokens while it is short of
    ``min_tokens`` and the tokens that would complete one of its bad words."""
    if metadata.blocked_rows is not None:
        logits[metadata.blocked_rows, metadata.blocked_token_ids] = float("-inf")
    return logits


def apply_token_bitmask(logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
    """In place on ``[B, V]`` logits: forbid (-inf) what each constrained row's grammar
    does not allow. Every later stage keeps -inf at -inf, so a forbidden token is never
    sampled; the grammar always allows at least one token (EOS when it is complete).
    On a CPU with kvloom's kernels, one native pass that skips whole words of allowed
    tokens (a free-text grammar's mask is nearly all ones: this PyTorch unpacking of
    every bit cost ~2.7 ms a step for 16 rows on AMD EPYC Milan); this is its reference."""
    if logits.device.type == "cpu" and native_sampling() and logits.dtype in (torch.float32, torch.bfloat16) \
            and logits.is_contiguous():
        sampling.apply_token_bitmask_(logits, grammar.rows, grammar.bitmask.contiguous())
        return logits
    return apply_token_bitmask_reference(logits, grammar)


def apply_token_bitmask_reference(logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
    """``apply_token_bitmask`` in PyTorch: every bit unpacked, any device."""
    num_rows, width = grammar.bitmask.shape
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    # `& 1` after the (arithmetic) shift makes the sign bit of negative words harmless.
    bits = (grammar.bitmask.unsqueeze(-1) >> shifts) & 1  # [C, W, 32]
    allowed = bits.reshape(num_rows, width * 32)[:, :vocab_size].bool()  # [C, V]
    logits[grammar.rows] = logits[grammar.rows].masked_fill_(~allowed, float("-inf"))
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """In place on ``[R, V]`` logits: set tokens outside top-k / the top-p nucleus to -inf.

    ``top_k`` holds V for rows without top-k and ``top_p`` 1.0 for rows without
    top-p. Tokens tied with the k-th largest logit are all kept. The nucleus is the
    smallest set of most likely tokens whose probability reaches p (the token that
    crosses p is kept; the most likely token always is), measured after top-k.
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # Top-k alone needs only the max_top_k largest values, not a full sort.
        largest = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
        # Rows without top-k hold V (>= max_top_k); clamp keeps the gather in range and
        # their cutoff is then reset to -inf so nothing is removed.
        k = top_k.clamp(max=max_top_k)
        cutoff = largest.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
        cutoff.masked_fill_((top_k >= vocab_size).unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < cutoff, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1)  # [R, V] ascending
    if top_k is not None:
        cutoff = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [R, 1], k-th largest
        sorted_logits.masked_fill_(sorted_logits < cutoff, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V], ascending order
    # Mass strictly above position i is 1 - cumulative[i]; drop i when that is >= p.
    outside_nucleus = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside_nucleus[:, -1] = False
    sorted_logits.masked_fill_(outside_nucleus, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place on ``[R, V]`` logits: drop tokens with prob < min_p * (max prob).

    Done in log space, p_i < min_p * p_max  <=>  x_i < x_max + log(min_p), which
    needs no softmax and is unchanged by top-k/top-p renormalisation (the max token
    always survives them), so its place after them does not change its meaning.
    min_p == 0 gives log 0 = -inf: nothing is dropped.
    """
    cutoff = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # [R, 1]
    return logits.masked_fill_(logits < cutoff, float("-inf"))


def compute_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, metadata: SamplingMetadata
) -> list[LogprobsEntry | None]:
    """Logprob, rank and top-n alternatives of each sampled token, from the raw logits."""
    return logprob_entries(logprob_tensors(raw_logits, token_ids, metadata), metadata)


def logprob_tensors(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                    metadata: SamplingMetadata) -> list[torch.Tensor]:
    """On the logits' device, for the L rows that want logprobs: their rows [L], sampled
    tokens [L], the sampled tokens' logprobs [L] and ranks [L], the top max_n ids and
    logprobs [L, max_n]; [] when no row wants any."""
    if metadata.logprob_rows is None:
        return []
    rows = metadata.logprob_rows
    logprobs = torch.log_softmax(raw_logits[rows], dim=-1)  # [L, V]
    sampled = token_ids[rows]  # [L]
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [L]
    ranks = (logprobs > sampled_logprobs.unsqueeze(1)).sum(dim=-1) + 1  # [L]
    top = logprobs.topk(metadata.max_num_logprobs, dim=-1)  # [L, max_n] each
    return [rows, sampled, sampled_logprobs, ranks, top.indices, top.values]


def logprob_entries(tensors: list[torch.Tensor], metadata: SamplingMetadata) -> list[LogprobsEntry | None]:
    """``logprob_tensors``' results (on the host) as one entry per row, None where the
    row asked for none. One host conversion per tensor, not one per element."""
    entries: list[LogprobsEntry | None] = [None] * metadata.num_rows
    if not tensors:
        return entries
    rows, sampled_ids, sampled_values, rank_values, top_ids, top_values = (tensor.tolist() for tensor in tensors)
    for i, (row, n) in enumerate(zip(rows, metadata.num_logprobs, strict=True)):
        entries[row] = LogprobsEntry(
            token_id=sampled_ids[i],
            logprob=sampled_values[i],
            rank=rank_values[i],
            top_logprobs=list(zip(top_ids[i][:n], top_values[i][:n], strict=True)),
        )
    return entries
