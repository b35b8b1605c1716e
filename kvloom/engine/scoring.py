"""Scoring continuations of one text: the log-probability of each choice's tokens
after it (kvloom.lang's ``select``, the server's ``POST /kvloom/score``).

Each choice is one engine request for ``text + choice`` with ``prompt_logprobs`` from
the first token where it tokenizes differently from ``text`` alone
(``prompt_logprobs_start``): the prefix before that is served by the prefix cache,
so submitted together the choices compute the shared prefix once (the first computes
it, the others wait one step for it and hit)."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.engine.admission import RequestRejected
from kvloom.engine.output import RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]  # text + choice
    start: int  # the choice's first token (>= 1: token 0 has no logprob)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=self.start,
                              output_kind=RequestOutputKind.FINAL_ONLY)  # only the end is read

    def logprob(self, output: RequestOutput) -> float:
        """The sum of the choice's tokens' log-probabilities, from the request's output."""
        entries = output.prompt_logprobs
        if entries is None:
            raise ValueError("the request computed no prompt logprobs")
        total = 0.0
        for position in range(self.start, len(self.token_ids)):
            entry = entries[position]
            assert entry is not None  # computed from prompt_logprobs_start on
            total += entry[self.token_ids[position]].logprob
        return total


def continuations(prefix: list[int], fulls: list[list[int]]) -> list[Continuation]:
    """One per choice (``fulls``: each ``text + choice`` tokenized).

    Raises ``RequestRejected`` where a choice would have no token to score: an empty
    text (a first token has no context), or a text and choice that are one token
    together. Scoring such a choice as 0.0 (probability 1) would make ``select`` prefer
    it over every other."""
    if not prefix:
        raise RequestRejected("the prompt is empty: a choice's first token needs the prompt as "
                              "its context to be scored", "prompt", "empty_prompt")
    result = []
    for index, full in enumerate(fulls):
        if len(full) < 2:
            raise RequestRejected(f"choice {index} and the prompt tokenize into {len(full)} token "
                                  "together, so no token of the choice follows the prompt to be "
                                  "scored", f"choices[{index}]", "invalid_value")
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        result.append(Continuation(full, max(1, min(common, len(full) - 1))))
    return result
