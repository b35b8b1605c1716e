"""POST /v1/chat/completions: the model's chat template, streaming and not."""

from __future__ import annotations

import time
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.output import CompletionOutput, TokenLogprobs
from kvloom.server.async_engine import ModelInfo
from kvloom.server.errors import bad_request
from kvloom.server.generation import (
    Serving,
    base_params,
    check_stream_options,
    collect,
    engine_requests,
    new_id,
    sampled_entry,
    top_entries,
)
from kvloom.server.protocol import ChatCompletionRequest, ChatMessage
from kvloom.server.responses import SSE_HEADERS, GenerationResponse

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    top_logprobs = _top_logprobs(body)
    params = base_params(body, serving.settings, top_logprobs, info)
    prompt = encode_messages(body.messages, info, add_generation_prompt=True)
    request_id = new_id("chatcmpl")
    stream = await serving.open(engine_requests(
        request_id, [prompt], params, body.effective_max_tokens, info, body.priority, "messages"))
    response = _Response(request_id, model, int(time.time()), top_logprobs)
    if body.stream:
        return StreamingResponse(
            response.stream(stream, request, [len(prompt)], params.n, body.include_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, [len(prompt)], params.n))


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
    """The prompt's token ids (``Tokenizer.encode_chat``, as ``LLM.chat`` encodes); a
    template's refusal is a 400."""
    conversation = [message.to_template() for message in messages]
    try:
        return info.tokenizer.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    except ValueError as error:  # no chat template
        raise bad_request(str(error), "messages") from None
    except jinja2.TemplateError as error:  # the template's own raise_exception, e.g. role order
        raise bad_request(f"the chat template rejected the messages: {error}", "messages") from None


class _Response(GenerationResponse):
    """A chat completion: choices hold a ``message``, chunks a ``delta``."""

    kind, full_object, chunk_object = "chat", "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, created: int, top_logprobs: int | None) -> None:
        super().__init__(request_id, model, created)
        self.top_logprobs = top_logprobs

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": self._logprobs(completion.logprobs),
                "finish_reason": completion.finish_reason}

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        # The first chunk of every choice names the role.
        return [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for index in range(num_choices)]

    def delta_logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        return self._logprobs(entries)

    def delta_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

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


def _token_logprob(logprob: Any) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode("utf-8"))}
