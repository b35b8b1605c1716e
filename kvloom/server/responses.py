"""One response of a generation endpoint, full or streamed as server-sent events.

``GenerationResponse`` owns what completions and chat share: the envelope (id,
object, created, model, choices, system_fingerprint), the usage block and the one SSE
loop (opening chunks, a chunk per visible delta, the usage chunk, ``[DONE]``, and an
error event instead of a hang or a traceback). A subclass only says what a choice
holds (``text`` or ``message`` / ``delta``) and how its logprobs are shaped.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from kvloom.engine.output import CompletionOutput, RequestOutput, TokenLogprobs
from kvloom.server.async_engine import EngineFailed, RequestAborted, ResultStream
from kvloom.server.errors import SERVER_ERROR, APIError, error_body
from kvloom.server.generation import UsageCounter, abort_on_disconnect, check_finished_cleanly, usage

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None) -> list[Any] | None:
    """vLLM's wire form: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if entries is None:
        return None
    return [None if entry is None else {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                                        "decoded_token": lp.decoded_token}
                                        for token_id, lp in entry.items()} for entry in entries]


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class GenerationResponse(ABC):
    """Builds the JSON objects of one response; choice ``i`` is engine request ``i`` of
    the group (``prompt_index * n + sample``)."""

    kind: str  # "chat" / "completion": names the stream in the log
    full_object: str  # the "object" of a full response
    chunk_object: str  # the "object" of a streamed chunk

    def __init__(self, request_id: str, model: str, created: int, return_token_ids: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.return_token_ids = return_token_ids  # vLLM's field: ids of prompts and outputs

    # ---- what a subclass says ----------------------------------------------------------
    @abstractmethod
    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        """A full response's choice for a finished completion."""

    @abstractmethod
    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        """The chunk choices sent before any output (chat's role, completions' echo)."""

    @abstractmethod
    def delta_logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """The logprobs of a streamed delta (None when they are off)."""

    @abstractmethod
    def delta_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any] | None:
        """A streamed chunk's choice for a visible delta (None: nothing to send yet)."""

    def seen(self, index: int, output: RequestOutput) -> RequestOutput:
        """Each streamed output of choice ``index`` as it arrives, before anything is
        counted or sent: what the stream takes from it (completions' echo reads the
        prompt's logprobs here). The output itself by default."""
        return output

    # ---- shared --------------------------------------------------------------------------
    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": None}

    def full(self, finals: dict[int, RequestOutput], prompt_lens: list[int], n: int) -> dict[str, Any]:
        """The whole response once every choice has finished."""
        data = self.envelope(self.full_object, [self.choice(index, finals[index].outputs[0])
                                                for index in sorted(finals)])
        # Each prompt counts once: its cache hit is its first sample's.
        cached = sum(finals[i].num_cached_tokens for i in finals if i % n == 0)
        data["usage"] = usage(prompt_lens, sum(len(f.outputs[0].token_ids) for f in finals.values()),
                              cached)
        details = self.completion_details([finals[index].outputs[0].token_ids for index in sorted(finals)])
        if details is not None:
            data["usage"]["completion_tokens_details"] = details
        if any(f.prompt_logprobs is not None for f in finals.values()):
            self.attach_prompt_logprobs(data, {index: prompt_logprobs_json(f.prompt_logprobs)
                                               for index, f in finals.items()})
        if self.return_token_ids:
            for choice in data["choices"]:
                final = finals[choice["index"]]
                choice["token_ids"] = list(final.outputs[0].token_ids)
                self.attach_prompt_token_ids(data, choice, final.prompt_token_ids)
        return data

    def completion_details(self, token_ids: list[Sequence[int]]) -> dict[str, Any] | None:
        """``usage.completion_tokens_details`` of outputs of ``token_ids`` (None: none)."""
        return None

    def attach_prompt_logprobs(self, data: dict[str, Any], by_choice: dict[int, list[Any] | None]) -> None:
        """vLLM's place for them: on each choice (completions; chat puts them on the response)."""
        for choice in data["choices"]:
            choice["prompt_logprobs"] = by_choice.get(choice["index"])

    def attach_prompt_token_ids(self, data: dict[str, Any], choice: dict[str, Any], token_ids: list[int]) -> None:
        """vLLM's place for them (``return_token_ids``): on each choice (completions; chat
        puts them on the response, or its stream's first chunk of each choice)."""
        choice["prompt_token_ids"] = list(token_ids)

    async def stream(self, stream: ResultStream, request: Request, prompt_lens: list[int], n: int,
                     include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """The SSE events of the response, ending with ``[DONE]`` or an error event.
        ``include_usage``: a last chunk with the usage, and ``"usage": null`` on the others;
        ``continuous_usage`` (vLLM's ``continuous_usage_stats``): the usage so far on each."""
        counter = UsageCounter(prompt_lens, n)
        # return_token_ids: each choice's ids not sent yet (a delta with no visible text
        # sends no chunk), and whether its prompt's ids went out.
        unsent: dict[int, list[int]] = {}
        prompt_sent: set[int] = set()
        generated: dict[int, list[int]] = {}  # each choice's tokens, for completion_details
        async with abort_on_disconnect(stream, request):
            try:
                for choice in self.opening_choices(len(stream.request_ids)):
                    yield self._chunk(choice, include_usage, counter.as_dict() if continuous_usage else None)
                async for index, output in stream:
                    output = self.seen(index, output)
                    counter.update(index, output)
                    completion = output.outputs[0]
                    generated.setdefault(index, []).extend(completion.delta_token_ids)
                    if output.finished:
                        check_finished_cleanly(output)
                    if self.return_token_ids:
                        unsent.setdefault(index, []).extend(completion.delta_token_ids)
                    logprobs = (self.delta_logprobs(index, completion.delta_logprobs)
                                if completion.delta_logprobs else None)
                    if not completion.delta_text and logprobs is None and not output.finished:
                        continue  # nothing visible yet (an incomplete character or stop string)
                    choice = self.delta_choice(index, completion.delta_text, logprobs,
                                               completion.finish_reason if output.finished else None)
                    if choice is None:
                        continue
                    data = self.envelope(self.chunk_object, [choice])
                    if self.return_token_ids:
                        choice["token_ids"] = unsent.pop(index, [])
                        if index not in prompt_sent:
                            prompt_sent.add(index)
                            self.attach_prompt_token_ids(data, choice, output.prompt_token_ids)
                    yield self._sse_chunk(data, include_usage, counter.as_dict() if continuous_usage else None)
                if stream.aborted:
                    return  # the client is gone; nobody reads a [DONE]
                if include_usage:
                    final_usage = counter.as_dict()
                    details = self.completion_details([generated[index] for index in sorted(generated)])
                    if details is not None:
                        final_usage["completion_tokens_details"] = details
                    yield sse({**self.envelope(self.chunk_object, []), "usage": final_usage})
                yield SSE_DONE
            except (RequestAborted, APIError) as error:
                if isinstance(error, APIError):
                    yield sse(error.body())
                else:
                    code = "engine_failed" if isinstance(error, EngineFailed) else "request_aborted"
                    yield sse(error_body(str(error), SERVER_ERROR, None, code))
            except Exception:  # noqa: BLE001 - a bug must end the stream, not hang it
                logger.exception("%s stream failed", self.kind)
                yield sse(error_body("internal server error", SERVER_ERROR, None, "internal_error"))

    def _chunk(self, choice: dict[str, Any], include_usage: bool, usage_so_far: dict[str, Any] | None) -> str:
        return self._sse_chunk(self.envelope(self.chunk_object, [choice]), include_usage, usage_so_far)

    @staticmethod
    def _sse_chunk(data: dict[str, Any], include_usage: bool, usage_so_far: dict[str, Any] | None) -> str:
        if include_usage:
            data["usage"] = usage_so_far
        return sse(data)
