"""The objects that cross boundaries: scheduler -> runner, engine -> caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.request import Request, RequestError, RequestTimeline


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``.

    ``start`` equals the request's num_computed_tokens when scheduled. The runner
    samples a token only when the chunk reaches the end of the known tokens.
    """

    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def is_prefill(self) -> bool:
        return not (self.num_new_tokens == 1 and self.samples and self.request.num_output_tokens > 0)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward pass, and nothing else."""

    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One generated position: the sampled token and the top-n alternatives.
TokenLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sequence's output. Cumulative fields plus the delta since the last step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    cache_miss_reason: str | None = None  # why the cache did not serve more of the prompt
    metrics: RequestTimeline | None = None
    error: RequestError | None = None  # with finish_reason "error": what went wrong
