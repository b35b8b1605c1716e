"""What the engine hands its caller: a request's cumulative output and the step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvloom.request import RequestError, RequestTimeline


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
    # With SamplingParams.prompt_logprobs, once the prompt is computed: entry i is prompt
    # token i under the tokens before it (entry 0, which has none, is None), as vLLM's.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prefill instance, on a KVExport request's final output: where its prompt's KV is
    # staged (kvloom/kv_spec.py StagedKV.as_dict()), for a decode instance to pull.
    kv_transfer_params: dict[str, Any] | None = None
