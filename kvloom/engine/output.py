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
    # A pooling request's (SamplingParams.pooling) vector, on its final output: its
    # embedding ("embed") or its class logits ("classify"); a token task's, one such
    # vector per prompt token ("token_embed", "token_classify").
    pooled: list[float] | list[list[float]] | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]  # L2-normalized, the model's hidden size


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer per prompt, as vLLM's: ``outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClassificationOutput:
    probs: list[float]  # by class index: softmax over the classes, or each one's sigmoid

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True, slots=True)
class ClassificationRequestOutput:
    """``LLM.classify``'s answer per prompt, as vLLM's: ``outputs.probs``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    """``LLM.encode``'s vector(s), as vLLM's ``PoolingOutput``: ``data`` is float32,
    [width] for an input's task ("embed", "classify"), [prompt tokens, width] for a
    token task ("token_embed", "token_classify")."""

    data: Any  # torch.Tensor (this module imports no torch)


@dataclass(frozen=True, slots=True)
class PoolingRequestOutput:
    """``LLM.encode``'s answer per prompt, as vLLM's: ``outputs.data``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    # A bi-encoder's: the cosine of the pair's two embeddings; a cross-encoder's: the
    # sigmoid of its one logit for the pair read as one input.
    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """``LLM.score``'s answer per pair, as vLLM's: ``outputs.score``; ``prompt_token_ids``
    are the pair's two prompts' ids, one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass(frozen=True, slots=True)
class StepProgress:
    """What one step did for one request, whatever its ``output_kind``: the server's
    metrics and dashboard count tokens and latencies from these, so a ``FINAL_ONLY``
    request (no ``RequestOutput`` before it finishes) is counted as it goes. One for
    every request that gained tokens or finished in the step (``LLMEngine.progress()``)."""

    request_id: str
    num_new_tokens: int  # appended by this step (0: it failed)
    num_output_tokens: int  # generated so far, these included
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    timeline: RequestTimeline
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished, else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_first_token(self) -> bool:
        """This step brought the request's first generated tokens."""
        return self.num_new_tokens > 0 and self.num_output_tokens == self.num_new_tokens
