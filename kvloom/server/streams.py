"""The types that cross between the HTTP layer and the engine thread.

``ResultStream`` is the event-loop side of one HTTP request's engine requests: the
engine thread fills it (through ``loop.call_soon_threadsafe``), a handler iterates it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvloom.engine.admission import AdmissionLimits
from kvloom.engine.output import RequestOutput
from kvloom.kv_spec import KVTransferSpec
from kvloom.lora.request import LoRARequest
from kvloom.model_families import ClassifierConfig
from kvloom.sampling_params import SamplingParams


class EngineNotReady(RuntimeError):
    """The model is still loading, failed to load, or the engine has stopped."""


class EngineOverloaded(RuntimeError):
    """Admitting the request would exceed ``max_waiting`` queued requests."""


class RequestAborted(RuntimeError):
    """The request ended without finishing (server shutdown or engine failure)."""


class EngineFailed(RequestAborted):
    """The engine itself failed (an exception in the forward pass, a kernel error), not
    one request: every in-flight request ends with a 500 and the server exits non-zero
    so that a supervisor restarts it."""


@dataclass(frozen=True)
class ModelInfo:
    """Facts the HTTP layer needs; fixed once the model has loaded."""

    model_name: str
    limits: AdmissionLimits  # the engine's own admission checks, run before fan-out
    tokenizer: Any
    # --generation-config: sampling defaults for what a request leaves unset
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # The instance's role and KV layout (GET /kvloom/kv_transfer; the router's handshake)
    kv_transfer: dict[str, Any] = field(default_factory=lambda: {"role": "both"})
    eos_token_ids: tuple[int, ...] = ()  # the engine's (what ends a beam, for beam search)
    # Embeddings' sizes: the hidden size, and the matryoshka sizes a request's `dimensions`
    # may ask for (None: not a matryoshka model; (): any size up to hidden_size).
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A sequence classifier's labels and activation (/classify; /score and /rerank as a
    # cross-encoder when it has one label); None for a causal LM.
    classifier: ClassifierConfig | None = None
    # vLLM's score template: the template given with --chat-template (the source), with
    # which a cross-encoder's /score and /rerank render each pair (None: the pair template).
    score_template: str | None = None

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


@dataclass(slots=True)
class EngineRequest:
    """One engine request (one sample of one prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer: KVTransferSpec | None = None  # prefill/decode disaggregation (kvloom/kv_spec.py)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only within the salt
    lora_request: LoRARequest | None = None  # the LoRA adapter the request's model names


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state read on the engine thread after ``check_integrity()`` passed."""

    num_blocks: int
    num_free_blocks: int
    num_available_blocks: int  # free + idle prefix-cache blocks (reclaimable)
    num_running: int
    num_waiting: int
    num_active_requests: int  # requests with a live stream


class ResultStream:
    """The outputs of a group of engine requests (the n samples of the prompts of one
    HTTP request), iterated as ``(index, RequestOutput)`` until all have finished."""

    def __init__(self, request_ids: list[str], on_abort: Callable[[ResultStream], None]) -> None:
        self.request_ids = request_ids
        self._on_abort = on_abort  # tells the engine thread to stop the requests
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        self._num_unfinished = len(request_ids)
        self._closed = False
        self.aborted = False  # closed by abort() before every request finished

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:  # abort() woke us up
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._closed = True
            raise item
        if item[1].finished:
            self._num_unfinished -= 1
            self._closed = self._num_unfinished == 0
        return item

    def abort(self) -> None:
        """Stop the group's unfinished requests and end the iteration (idempotent; a
        no-op once every request has finished). Event loop only."""
        if not self._closed:
            self._closed = self.aborted = True
            self._queue.put_nowait(None)
            self._on_abort(self)

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        """Deliver an output or a terminal error (event loop only; dropped once closed)."""
        if not self._closed:
            self._queue.put_nowait(item)
