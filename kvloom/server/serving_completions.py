"""POST /v1/completions: OpenAI's legacy completions, streaming and not."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.output import RequestOutput, TokenLogprobs
from kvloom.server.async_engine import EngineFailed, ModelInfo, RequestAborted, ResultStream
from kvloom.server.errors import SERVER_ERROR, APIError, bad_request, error_body
from kvloom.server.generation import (
    SSE_DONE,
    SSE_HEADERS,
    Serving,
    UsageCounter,
    abort_on_disconnect,
    base_params,
    check_finished_cleanly,
    check_stream_options,
    check_token_ids,
    collect,
    engine_requests,
    new_id,
    sampled_entry,
    sse,
    top_entries,
    usage,
)
from kvloom.server.protocol import CompletionRequest

logger = logging.getLogger(__name__)


async def create_completion(body: CompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    if body.echo and body.logprobs is not None:
        # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
        raise bad_request("echo together with logprobs is not supported (prompt logprobs are "
                          "not computed)", "echo")
    params = base_params(body, serving.settings, body.logprobs)
    prompts, texts = _encode_prompts(body.prompt, info)
    request_id = new_id("cmpl")
    stream = await serving.open(engine_requests(
        request_id, prompts, params, body.max_tokens, info, body.priority, "prompt"))
    response = _Response(request_id, model, int(time.time()), body, texts, info)
    prompt_lens = [len(p) for p in prompts]
    if body.stream:
        return StreamingResponse(response.stream(stream, request, prompt_lens, params.n),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, prompt_lens, params.n))


def _encode_prompts(prompt: Any, info: ModelInfo) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (text is what ``echo`` sends back)."""
    tokenizer = info.tokenizer
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    batch = [prompt] if isinstance(prompt[0], int) else prompt
    for token_ids in batch:
        check_token_ids(token_ids, info, "prompt")
    return batch, [tokenizer.decode(ids, skip_special_tokens=False) for ids in batch]


class _Response:
    """Builds the JSON objects of one completion response (full or chunked)."""

    def __init__(self, request_id: str, model: str, created: int, body: CompletionRequest,
                 prompt_texts: list[str], info: ModelInfo) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.body = body
        self.prompt_texts = prompt_texts
        self.info = info

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": None}

    def full(self, finals: dict[int, RequestOutput], prompt_lens: list[int], n: int) -> dict[str, Any]:
        choices = []
        for index in sorted(finals):
            completion = finals[index].outputs[0]
            prefix = self.prompt_texts[index // n] if self.body.echo else ""
            choices.append({
                "index": index, "text": prefix + completion.text,
                "logprobs": self._logprobs(completion.logprobs, len(prefix)),
                "finish_reason": completion.finish_reason})
        data = self._envelope(choices)
        cached = sum(finals[i].num_cached_tokens for i in finals if i % n == 0)
        data["usage"] = usage(prompt_lens, sum(len(f.outputs[0].token_ids) for f in finals.values()),
                              cached)
        return data

    def _logprobs(self, entries: list[TokenLogprobs] | None, offset: int) -> dict[str, Any] | None:
        """The legacy shape: parallel lists, one element per generated token."""
        if entries is None or self.body.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            _, sampled = sampled_entry(entry)
            text = sampled.decoded_token or ""
            tokens.append(text)
            token_logprobs.append(sampled.logprob)
            top = {lp.decoded_token or "": lp.logprob for _, lp in top_entries(entry, self.body.logprobs)}
            top.setdefault(text, sampled.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    async def stream(self, stream: ResultStream, request: Request, prompt_lens: list[int],
                     n: int) -> AsyncIterator[str]:
        counter = UsageCounter(prompt_lens, n)
        # Per choice: characters sent so far, for text_offset.
        sent = {index: 0 for index in range(len(stream.request_ids))}
        include_usage = self.body.include_usage_in_stream
        async with abort_on_disconnect(stream, request):
            try:
                if self.body.echo:
                    for index in sent:
                        text = self.prompt_texts[index // n]
                        sent[index] = len(text)
                        yield self._chunk(index, text, None, None, include_usage)
                async for index, output in stream:
                    counter.update(index, output)
                    completion = output.outputs[0]
                    if output.finished:
                        check_finished_cleanly(output)
                    logprobs = (self._logprobs(completion.delta_logprobs, sent[index])
                                if completion.delta_logprobs else None)
                    if not completion.delta_text and logprobs is None and not output.finished:
                        continue  # nothing visible yet (an incomplete character or stop string)
                    sent[index] += len(completion.delta_text)
                    yield self._chunk(index, completion.delta_text, logprobs,
                                      completion.finish_reason if output.finished else None,
                                      include_usage)
                if stream.aborted:
                    return  # the client is gone; nobody reads a [DONE]
                if include_usage:
                    yield sse({**self._envelope([]), "usage": counter.as_dict()})
                yield SSE_DONE
            except (RequestAborted, APIError) as error:
                if isinstance(error, APIError):
                    yield sse(error.body())
                else:
                    code = "engine_failed" if isinstance(error, EngineFailed) else "request_aborted"
                    yield sse(error_body(str(error), SERVER_ERROR, None, code))
            except Exception:  # noqa: BLE001 - a bug must end the stream, not hang it
                logger.exception("completion stream failed")
                yield sse(error_body("internal server error", SERVER_ERROR, None, "internal_error"))

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None,
               finish_reason: str | None, include_usage: bool) -> str:
        data = self._envelope([{"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish_reason}])
        if include_usage:
            data["usage"] = None
        return sse(data)
