"""POST /v1/chat/completions: the model's chat template, streaming and not."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
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
    collect,
    engine_requests,
    new_id,
    sampled_entry,
    sse,
    top_entries,
    usage,
)
from kvloom.server.protocol import ChatCompletionRequest, ChatMessage

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    top_logprobs = _top_logprobs(body)
    params = base_params(body, serving.settings, top_logprobs)
    prompt = encode_messages(body.messages, info, add_generation_prompt=True)
    request_id = new_id("chatcmpl")
    stream = await serving.open(engine_requests(
        request_id, [prompt], params, body.effective_max_tokens, info, body.priority, "messages"))
    response = _Response(request_id, model, int(time.time()), top_logprobs)
    if body.stream:
        return StreamingResponse(
            response.stream(stream, request, len(prompt), params.n, body.include_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, len(prompt)))


def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    """The SamplingParams.logprobs value: None when logprobs are off."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                              f"{body.top_logprobs}", "top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def encode_messages(messages: list[ChatMessage], info: ModelInfo, add_generation_prompt: bool
                    ) -> list[int]:
    """Render with the tokenizer's chat template, then tokenize without a second BOS."""
    conversation = [message.to_template() for message in messages]
    try:
        text = info.tokenizer.apply_chat_template(conversation,
                                                  add_generation_prompt=add_generation_prompt)
    except ValueError as error:  # no chat template
        raise bad_request(str(error), "messages") from None
    except jinja2.TemplateError as error:  # the template's own raise_exception, e.g. role order
        raise bad_request(f"the chat template rejected the messages: {error}", "messages") from None
    return info.tokenizer.encode(text, add_special_tokens=False)


class _Response:
    """Builds the JSON objects of one chat completion response (full or chunked)."""

    def __init__(self, request_id: str, model: str, created: int, top_logprobs: int | None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.top_logprobs = top_logprobs

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": None}

    def full(self, finals: dict[int, RequestOutput], prompt_len: int) -> dict[str, Any]:
        choices = []
        for index in sorted(finals):
            completion = finals[index].outputs[0]
            choices.append({
                "index": index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": self._logprobs(completion.logprobs),
                "finish_reason": completion.finish_reason})
        data = self._envelope("chat.completion", choices)
        # One prompt: its cache hit is the first sample's.
        cached = finals[0].num_cached_tokens if 0 in finals else 0
        data["usage"] = usage([prompt_len], sum(len(f.outputs[0].token_ids) for f in finals.values()),
                              cached)
        return data

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and alternatives."""
        if entries is None or self.top_logprobs is None:
            return None
        content = []
        for entry in entries:
            _, sampled = sampled_entry(entry)
            item = _token_logprob(sampled)
            item["top_logprobs"] = [_token_logprob(lp) for _, lp in top_entries(entry, self.top_logprobs)]
            content.append(item)
        return {"content": content, "refusal": None}

    async def stream(self, stream: ResultStream, request: Request, prompt_len: int, n: int,
                     include_usage: bool) -> AsyncIterator[str]:
        counter = UsageCounter([prompt_len], n)
        async with abort_on_disconnect(stream, request):
            try:
                for index in range(n):  # the first chunk of every choice names the role
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None,
                                      include_usage)
                async for index, output in stream:
                    counter.update(index, output)
                    completion = output.outputs[0]
                    if output.finished:
                        check_finished_cleanly(output)
                    logprobs = (self._logprobs(completion.delta_logprobs)
                                if completion.delta_logprobs else None)
                    if not completion.delta_text and logprobs is None and not output.finished:
                        continue  # nothing visible yet (an incomplete character or stop string)
                    delta = {"content": completion.delta_text} if completion.delta_text else {}
                    yield self._chunk(index, delta, logprobs,
                                      completion.finish_reason if output.finished else None,
                                      include_usage)
                if stream.aborted:
                    return  # the client is gone; nobody reads a [DONE]
                if include_usage:
                    yield sse({**self._envelope("chat.completion.chunk", []), "usage": counter.as_dict()})
                yield SSE_DONE
            except (RequestAborted, APIError) as error:
                if isinstance(error, APIError):
                    yield sse(error.body())
                else:
                    code = "engine_failed" if isinstance(error, EngineFailed) else "request_aborted"
                    yield sse(error_body(str(error), SERVER_ERROR, None, code))
            except Exception:  # noqa: BLE001 - a bug must end the stream, not hang it
                logger.exception("chat stream failed")
                yield sse(error_body("internal server error", SERVER_ERROR, None, "internal_error"))

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None, include_usage: bool) -> str:
        data = self._envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
        if include_usage:
            data["usage"] = None
        return sse(data)


def _token_logprob(logprob: Any) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode("utf-8"))}
