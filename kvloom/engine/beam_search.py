"""Beam search, as vLLM's ``LLM.beam_search``: the algorithm, apart from what drives it.

A search keeps ``beam_width`` live beams per prompt. Each round, every live beam asks
the engine for one token with its ``2 * beam_width`` best log-probabilities (a request
of the prompt plus the beam's tokens, ``max_tokens`` 1, greedy; the radix cache
serves all but its last token, so a round computes about one token per beam). Each
beam and each of its candidates make a new beam whose score adds the candidate's
log-probability; a candidate that is an EOS token finishes its beam (unless
``ignore_eos``), the rest compete, and the ``beam_width`` best of them live on. After
``max_tokens`` rounds, or once no beam is live, the finished and the live beams are
ranked together and the ``beam_width`` best returned.

Ranking, as vLLM's ``get_beam_search_score``: the cumulative log-probability over
``(prompt + generated tokens, less a final EOS) ** length_penalty``, so beams of
different lengths compare (a higher ``length_penalty`` favours longer ones). Log-
probabilities are the model's own (log-softmax of the raw logits): there is no
temperature, and a search is deterministic.

Two drivers run it: ``LLM.beam_search`` (offline) and the server's ``use_beam_search``
(kvloom/server/beam_search.py); both hand each round's candidates to ``advance``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloom.engine.output import RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams

MAX_BEAM_WIDTH = 64  # each live beam asks for 2 x width log-probabilities a round
# |length_penalty| at most this: a length of up to 2 ** 20 tokens raised to it stays a
# finite, non-zero float (beyond it the score would overflow or divide by zero).
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's fields: ``beam_width`` beams, each at most ``max_tokens`` tokens;
    ``ignore_eos``: an EOS token is a token like any other (never finishes a beam);
    ``length_penalty``: the exponent of the length that divides a beam's score."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name, value, least in (("beam_width", self.beam_width, 1), ("max_tokens", self.max_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                             f"got {self.length_penalty!r}")

    def check_max_logprobs(self, max_logprobs: int) -> None:
        """A round's ``2 * beam_width`` log-probabilities are a request's like any other:
        within the engine's max_logprobs (vLLM's rule), refused up front rather than mid-search."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width {self.beam_width} asks for {2 * self.beam_width} log-probabilities a "
                             f"token each round, more than the engine's max_logprobs ({max_logprobs}); "
                             f"--max-logprobs {2 * self.beam_width} (LLM(max_logprobs=...)) serves it")

    def round_params(self) -> SamplingParams:
        """What each live beam asks the engine for in a round: its next token's
        ``2 * beam_width`` best log-probabilities (the greedy token is the best of them)."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * self.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass(slots=True)
class BeamSequence:
    """One beam: the tokens it generated, each one's log-probability, their sum."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (an EOS token, the last of token_ids) or "length"
    text: str = ""  # filled in by the driver once the search ends: output_token_ids' text

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens its text is made of: all but a final EOS (vLLM's rule)."""
        return self.token_ids[:-1] if self.finish_reason == "stop" else self.token_ids

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = prompt_len + len(self.token_ids) - (1 if self.finish_reason == "stop" else 0)
        return self.cum_logprob / math.pow(length, length_penalty)


class BeamSearch:
    """One prompt's search: the live beams, the finished ones, and one round at a time."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.live: list[BeamSequence] = [BeamSequence()]
        self.finished: list[BeamSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.live or self.rounds >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        """This round's requests: each live beam's prompt and tokens so far."""
        return [self.prompt_token_ids + beam.token_ids for beam in self.live]

    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One round: ``candidates[i]`` are live beam i's next tokens with their
        log-probabilities (its ``2 * beam_width`` best)."""
        if self.done:
            raise RuntimeError("the beam search has ended")
        if len(candidates) != len(self.live):
            raise ValueError(f"got candidates for {len(candidates)} beams, {len(self.live)} are live")
        self.rounds += 1
        grown: list[BeamSequence] = []
        for beam, options in zip(self.live, candidates, strict=True):
            for token_id, logprob in options:
                child = BeamSequence(beam.token_ids + [token_id], beam.logprobs + [logprob],
                                     beam.cum_logprob + logprob)
                if token_id in self.eos_token_ids:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    grown.append(child)
        # Stable: among equal scores the earlier beam's candidate, in its candidates' order.
        grown.sort(key=self._score, reverse=True)
        self.live = grown[:self.params.beam_width]
        if self.rounds >= self.params.max_tokens:
            for beam in self.live:
                beam.finish_reason = "length"

    def best(self) -> list[BeamSequence]:
        """The ``beam_width`` best of the finished and the live beams, best first."""
        return sorted(self.finished + self.live, key=self._score, reverse=True)[:self.params.beam_width]

    def _score(self, beam: BeamSequence) -> float:
        return beam.score(len(self.prompt_token_ids), self.params.length_penalty)


def advance_round(searches: Sequence[BeamSearch], outputs: Sequence[RequestOutput]) -> None:
    """One round of every search in ``searches`` (none done): ``outputs`` are the final
    outputs of the round's requests, in the order of ``prompts()``, search after search."""
    if len(outputs) != sum(len(search.live) for search in searches):
        raise ValueError(f"got {len(outputs)} outputs for {sum(len(s.live) for s in searches)} live beams")
    at = 0
    for search in searches:
        count = len(search.live)
        search.advance([candidates_from(output, 2 * search.params.beam_width) for output in outputs[at:at + count]])
        at += count


def candidates_from(output: RequestOutput, count: int) -> list[tuple[int, float]]:
    """A round's answer for one beam (its request's final output, with the
    ``round_params``' logprobs): its next tokens by log-probability, best first."""
    completion = output.outputs[0]
    if completion.finish_reason not in ("stop", "length") or not completion.logprobs:
        raise RuntimeError(f"a beam's round ended {completion.finish_reason!r}"
                           + (f": {output.error.message}" if output.error is not None else ""))
    ranked = sorted(((token_id, value.logprob) for token_id, value in completion.logprobs[0].items()),
                    key=lambda pair: (-pair[1], pair[0]))
    return ranked[:count]
