"""The engine's record of one request: tokens, progress, KV blocks and timeline.

Owners: the scheduler (engine/scheduler.py) is the one writer of everything here
but ``block_ids``, which the KV cache manager (cache/kv_manager.py) writes, and
``state_slot``, which the state pool (cache/state_pool.py) writes. Others read.

Invariant: ``num_computed_tokens <= num_tokens``; the KV of the first
``num_computed_tokens`` tokens lives in ``block_ids`` (in logical order), but for the
leading entries a request under a sliding window has let go (``NO_BLOCK``: no query of
its reads them again; cache/kv_manager.py). A request
whose ``num_computed_tokens == num_tokens`` is "decoding": its next step computes the
last sampled token and samples another.

With overlap scheduling (engine/engine.py) the token a step samples is appended one
engine step later, after the next step has been scheduled and launched; until then
it is ``num_pending_tokens`` (0 or 1), a token of known position and unknown value,
which the next step may already compute (its input id is read on the device).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvloom.kv_spec import KVTransferSpec
from kvloom.sampling_params import SamplingParams

NO_BLOCK = -1  # a ``block_ids`` entry let go: a block wholly behind every layer's sliding window


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; KV freed, recomputed on resume
    RECEIVING = "receiving"  # admitted with blocks; its prompt's KV is arriving from a prefill instance
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(slots=True)
class RequestTimeline:
    """Wall-clock and step stamps of a request's life; exposed as RequestOutput.metrics."""

    arrival_time: float
    arrival_step: int = 0
    first_scheduled_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    finished_step: int | None = None
    # (step, num_tokens) of every prefill chunk, including recompute after preemption.
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    preempted_steps: list[int] = field(default_factory=list)
    resumed_steps: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why one request failed while the engine went on serving the others.

    ``caused_by_request``: its own input made it fail (a grammar too complex to
    follow, ...), which a server reports as 400; otherwise it hit our bug (500).
    """

    message: str
    caused_by_request: bool = False

    @classmethod
    def output_failed(cls, error: Exception) -> RequestError:
        """Turning the request's tokens into output (detokenizing, ...) raised: our bug."""
        return cls(f"processing the output failed: {type(error).__name__}: {error}")

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True, eq=False, repr=False)  # eq=False: requests hash by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0  # global admission order; breaks ties deterministically
    prompt: str | None = None
    # Prefill/decode disaggregation: stage this prompt's KV (prefill instance) or pull
    # it (decode instance); None: computed and decoded here (kvloom/kv_spec.py).
    kv_transfer: KVTransferSpec | None = None
    # vLLM's cache_salt: the prefix cache serves this request only what requests of the
    # same salt left there (one tenant's), and keeps its blocks apart from the others'.
    cache_salt: str | None = None
    # The LoRA adapter it runs with, as the prefix cache tells adapters apart (its name
    # and the load that bound it: kvloom/lora/manager.py); None: the base model.
    lora_key: str | None = None
    # A pooling request that reads every prompt position's final state (a token task,
    # or an embedding pooled by the mean or the first token: runner/token_pooling.py):
    # its whole prompt is computed (no prefix-cache hit) and every row kept.
    pools_every_token: bool = False
    # LongRoPE served past its original context (ModelConfig.long_rope_from) and a prompt
    # longer than it: every token it computes turns by the long factors (as transformers
    # computes such a prompt in one forward); else only its tokens past that context.
    long_rope: bool = False
    # The prefix cache's namespace for it: its salt's, an adapter's own (its KV is not the
    # base model's), and a long-factor prompt's (its KV turned otherwise). Salts and
    # adapter names hold no NUL, so no two collide.
    cache_key: str | None = field(init=False, default=None)

    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; kept as one list so slicing the next chunk never concatenates.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Sampled by a step still in flight, not appended yet (0 or 1; see the module doc).
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    cache_miss_reason: str | None = None  # why the prefix cache did not serve (more of) the prompt
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # a state-space model's state slot (cache/state_pool.py)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: RequestError | None = None  # set with status FINISHED_ERROR
    num_preemptions: int = 0
    # Speculative decoding: the proposer's guesses at the tokens after the last one,
    # for the next step to verify (never the request's tokens until verified); drafts
    # verified and accepted so far; a running estimate of the chance that a draft
    # token is accepted, which sets how many are proposed (engine/speculation.py).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_acceptance: float = 1.0
    timeline: RequestTimeline = field(init=False)

    @property
    def adapter_name(self) -> str | None:
        """The LoRA adapter's name (``lora_key`` is "<name>\\0<binding>": LoRAManager.acquire;
        names hold no NUL); None: the base model."""
        return None if self.lora_key is None else self.lora_key.partition("\0")[0]

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.cache_key = (self.cache_salt if self.lora_key is None
                          else f"{self.cache_salt or ''}\0lora\0{self.lora_key}")
        if self.long_rope:
            self.cache_key = f"{self.cache_key or ''}\0long_rope"
        self.timeline = RequestTimeline(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Appended tokens and the pending one, if any: where the next step starts."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the request's max_tokens, capped by the model's context."""
        room = self.max_model_len - self.num_prompt_tokens
        requested = self.sampling_params.max_tokens
        return room if requested is None else min(requested, room)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)})")

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
