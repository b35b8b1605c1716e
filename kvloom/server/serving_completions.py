"""POST /v1/completions: OpenAI's legacy completions, streaming and not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.output import CompletionOutput, RequestOutput, TokenLogprobs
from kvloom.server.async_engine import ModelInfo
from kvloom.server.beam_search import answer, beam_search, check_beam_request
from kvloom.server.generation import (
    Serving,
    base_params,
    check_n_and_store,
    check_stream_options,
    collect,
    encode_prompts,
    engine_requests,
    open_with_kv_transfer,
    response_ids,
    sampled_entry,
    token_name,
    top_entries,
    truncate_prompt,
    usage,
)
from kvloom.server.protocol import CompletionRequest
from kvloom.server.responses import SSE_HEADERS, GenerationResponse


async def create_completion(body: CompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    if body.use_beam_search:
        return await _beam_search_completion(body, request, serving, info, model)
    # echo with logprobs scores the prompt too (lm-eval's loglikelihood requests), and
    # with max_tokens 0 only the prompt, as vLLM's "echo without generation".
    scores_prompt = body.echo and body.logprobs is not None
    prompt_only = body.echo and body.max_tokens == 0
    params = base_params(body, serving.settings, body.logprobs, info)
    if scores_prompt:
        params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs or 0, params.prompt_logprobs or 0))
    prompts, texts = _prompts(body, info)
    request_id, engine_id = response_ids("cmpl", body)
    stream = await open_with_kv_transfer(serving, request, engine_requests(
        engine_id, prompts, params, 1 if prompt_only else body.max_tokens, info, body.priority, "prompt",
        body.cache_salt, serving.lora_for(body.model, info)),
        body.kv_transfer_params, params.n)
    if isinstance(stream, JSONResponse):  # the prefill leg, answered
        return stream
    response = _Response(request_id, model, int(time.time()), body, texts, params.n, info, prompt_only,
                         body.return_tokens_as_token_ids or serving.settings.return_tokens_as_token_ids)
    prompt_lens = [len(p) for p in prompts]
    if body.stream:
        return StreamingResponse(
            response.stream(stream, request, prompt_lens, params.n,
                            body.include_usage_in_stream or serving.settings.force_include_usage,
                            body.continuous_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, prompt_lens, params.n))


async def _beam_search_completion(body: CompletionRequest, request: Request, serving: Serving, info: ModelInfo,
                                  model: str) -> JSONResponse | StreamingResponse:
    check_beam_request(body)
    check_n_and_store(body, serving.settings)
    prompts, texts = _prompts(body, info)
    request_id, engine_id = response_ids("cmpl", body)
    finals = await beam_search(serving, request, engine_id, prompts, body, body.max_tokens, info, "prompt")
    response = _Response(request_id, model, int(time.time()), body, texts, body.n, info)
    return answer(response, finals, [len(p) for p in prompts], body, request, serving.settings)


def _prompts(body: CompletionRequest, info: ModelInfo) -> tuple[list[list[int]], list[str]]:
    """The request's prompts as token ids and text, after ``truncate_prompt_tokens``
    (``echo`` then sends back the part kept)."""
    prompts, texts = encode_prompts(body.prompt, info, body.add_special_tokens)
    if body.truncate_prompt_tokens is None:
        return prompts, texts
    kept = [truncate_prompt(ids, body.truncate_prompt_tokens, info) for ids in prompts]
    texts = [text if len(ids) == len(whole) else info.tokenizer.decode(ids, skip_special_tokens=False)
             for text, ids, whole in zip(texts, kept, prompts, strict=True)]
    return kept, texts


class _Response(GenerationResponse):
    """A legacy completion: choices hold ``text`` (after the prompt, with ``echo``)."""

    kind, full_object, chunk_object = "completion", "text_completion", "text_completion"

    def __init__(self, request_id: str, model: str, created: int, body: CompletionRequest,
                 prompt_texts: list[str], n: int, info: ModelInfo, prompt_only: bool = False,
                 tokens_as_ids: bool = False) -> None:
        super().__init__(request_id, model, created, body.return_token_ids)
        self.body, self.prompt_texts, self.n = body, prompt_texts, n
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids, the request's or the server's
        self.tokenizer = info.tokenizer
        self.prompt_only = prompt_only  # echo with max_tokens 0: the one generated token is dropped
        self.sent: dict[int, int] = {}  # per streamed choice: characters sent, for text_offset
        # Streamed with echo and logprobs (or max_tokens 0), as vLLM's: each choice's prompt
        # goes out with its first delta, scored, once the prompt is computed (``seen``).
        self.echo_with_first_delta = body.echo and (body.logprobs is not None or prompt_only)
        self.echoing: dict[int, tuple[str, dict[str, Any] | None]] = {}  # prompt text and logprobs, to send
        self.echoed: set[int] = set()

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        prefix = self.prompt_texts[index // self.n] if self.body.echo else ""
        if self.prompt_only:
            return {"index": index, "text": prefix, "logprobs": None, "finish_reason": "length"}
        return {"index": index, "text": prefix + completion.text,
                "logprobs": self._logprobs(completion.logprobs, len(prefix)),
                "finish_reason": completion.finish_reason}

    def full(self, finals: dict[int, RequestOutput], prompt_lens: list[int], n: int) -> dict[str, Any]:
        data = super().full(finals, prompt_lens, n)
        if self.prompt_only:
            data["usage"] = usage(prompt_lens, 0, data["usage"]["prompt_tokens_details"]["cached_tokens"])
            for choice in data["choices"]:
                if "token_ids" in choice:
                    choice["token_ids"] = []  # the one token generated is dropped
        if self.body.echo and self.body.logprobs is not None:
            for choice in data["choices"]:  # the prompt's tokens first, the first one unscored
                final = finals[choice["index"]]
                known = final.prompt_logprobs or []
                entries = [known[i] if i < len(known) else None for i in range(len(final.prompt_token_ids))]
                scored = self._logprobs(entries, 0, final.prompt_token_ids)
                assert scored is not None  # logprobs were asked for
                if choice["logprobs"] is not None:
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        scored[key] += choice["logprobs"][key]
                choice["logprobs"] = scored
                if self.body.prompt_logprobs is None:
                    choice.pop("prompt_logprobs", None)  # asked for through echo, not as vLLM's field
        return data

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        self.sent = dict.fromkeys(range(num_choices), 0)
        if not self.body.echo or self.echo_with_first_delta:
            return []
        return [self.delta_choice(index, self.prompt_texts[index // self.n], None, None)
                for index in range(num_choices)]

    def seen(self, index: int, output: RequestOutput) -> RequestOutput:
        if not self.echo_with_first_delta:
            return output
        if index not in self.echoed:  # its first output: the prompt is computed, its logprobs known
            self.echoed.add(index)
            text = self.prompt_texts[index // self.n]
            scored = None
            if self.body.logprobs is not None:
                known = output.prompt_logprobs or []
                entries = [known[i] if i < len(known) else None for i in range(len(output.prompt_token_ids))]
                scored = self._logprobs(entries, 0, output.prompt_token_ids)
            self.echoing[index] = (text, scored)
            self.sent[index] = len(text)  # the generated tokens' offsets follow the prompt
        if self.prompt_only:  # the one token generated is dropped: the choice ends at its prompt
            completion = output.outputs[0]
            ended = "length" if completion.finish_reason in ("stop", "length") else completion.finish_reason
            completion = dataclasses.replace(completion, delta_text="", delta_token_ids=[], delta_logprobs=None,
                                             finish_reason=ended)
            output = dataclasses.replace(output, outputs=[completion])
        return output

    def delta_logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        return self._logprobs(entries, self.sent[index])

    def delta_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any]:
        self.sent[index] += len(text)
        if index in self.echoing:  # the prompt first, and its logprobs before the delta's
            prompt, scored = self.echoing.pop(index)
            text = prompt + text
            if scored is not None and logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    scored[key] += logprobs[key]
            logprobs = scored if scored is not None else logprobs
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, entries: Sequence[TokenLogprobs | None] | None, offset: int,
                  token_ids: list[int] | None = None) -> dict[str, Any] | None:
        """The legacy shape: parallel lists, one element per token. An entry is None only
        for an echoed prompt's token that nothing scored (its first): ``token_ids`` give
        its text, and its logprob and alternatives are null."""
        if entries is None or self.body.logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        as_ids = self.tokens_as_ids
        for position, entry in enumerate(entries):
            if entry is None:
                assert token_ids is not None
                token_id = token_ids[position]
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                token_logprobs.append(None)
                tops.append(None)
            else:
                token_id, sampled = sampled_entry(entry)
                text = sampled.decoded_token or ""
                token_logprobs.append(sampled.logprob)
                top = {token_name(alternative, lp.decoded_token, as_ids): lp.logprob
                       for alternative, lp in top_entries(entry, self.body.logprobs)}
                top.setdefault(token_name(token_id, text, as_ids), sampled.logprob)
                tops.append(top)
            tokens.append(token_name(token_id, text, as_ids))
            offsets.append(offset)  # the text's characters, whatever names the token
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
