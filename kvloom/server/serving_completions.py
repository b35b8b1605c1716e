"""POST /v1/completions: OpenAI's legacy completions, streaming and not."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.output import CompletionOutput, TokenLogprobs
from kvloom.server.async_engine import ModelInfo
from kvloom.server.errors import bad_request
from kvloom.server.generation import (
    Serving,
    base_params,
    check_stream_options,
    check_token_ids,
    collect,
    engine_requests,
    new_id,
    open_with_kv_transfer,
    sampled_entry,
    top_entries,
)
from kvloom.server.protocol import CompletionRequest
from kvloom.server.responses import SSE_HEADERS, GenerationResponse


async def create_completion(body: CompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    if body.echo and body.logprobs is not None:
        # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
        raise bad_request("echo together with logprobs is not supported (prompt logprobs are "
                          "not computed)", "echo")
    params = base_params(body, serving.settings, body.logprobs, info)
    prompts, texts = _encode_prompts(body.prompt, info, body.add_special_tokens)
    request_id = new_id("cmpl")
    stream = await open_with_kv_transfer(serving, request, engine_requests(
        request_id, prompts, params, body.max_tokens, info, body.priority, "prompt"), body.kv_transfer_params, params.n)
    if isinstance(stream, JSONResponse):  # the prefill leg, answered
        return stream
    response = _Response(request_id, model, int(time.time()), body, texts, params.n)
    prompt_lens = [len(p) for p in prompts]
    if body.stream:
        return StreamingResponse(
            response.stream(stream, request, prompt_lens, params.n, body.include_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, prompt_lens, params.n))


def _encode_prompts(prompt: Any, info: ModelInfo, special: bool) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (text is what ``echo`` sends back); ``special``:
    text is tokenized with the special tokens (a BOS)."""
    tokenizer = info.tokenizer
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=special)], [prompt]
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p, add_special_tokens=special) for p in prompt], list(prompt)
    batch = [prompt] if isinstance(prompt[0], int) else prompt
    for token_ids in batch:
        check_token_ids(token_ids, info, "prompt")
    return batch, [tokenizer.decode(ids, skip_special_tokens=False) for ids in batch]


class _Response(GenerationResponse):
    """A legacy completion: choices hold ``text`` (after the prompt, with ``echo``)."""

    kind, full_object, chunk_object = "completion", "text_completion", "text_completion"

    def __init__(self, request_id: str, model: str, created: int, body: CompletionRequest,
                 prompt_texts: list[str], n: int) -> None:
        super().__init__(request_id, model, created)
        self.body, self.prompt_texts, self.n = body, prompt_texts, n
        self.sent: dict[int, int] = {}  # per streamed choice: characters sent, for text_offset

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_texts[index // self.n] if self.body.echo else ""
        return {"index": index, "text": prefix + completion.text,
                "logprobs": self._logprobs(completion.logprobs, len(prefix)),
                "finish_reason": completion.finish_reason}

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        self.sent = dict.fromkeys(range(num_choices), 0)
        if not self.body.echo:
            return []
        return [self.delta_choice(index, self.prompt_texts[index // self.n], None, None)
                for index in range(num_choices)]

    def delta_logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        return self._logprobs(entries, self.sent[index])

    def delta_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any]:
        self.sent[index] += len(text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

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
