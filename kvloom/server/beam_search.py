"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's): the search of
engine/beam_search.py, each round's live beams sent to the engine as one group.

``n`` is the beam width and the number of choices (each prompt's ``n`` best beams, best
first), ``length_penalty`` ranks them, ``max_tokens`` and ``ignore_eos`` bound them.
Beam search picks tokens by the model's log-probabilities alone, so a field that would
sample, penalize, constrain or stop otherwise is a 400 naming it (as are ``logprobs``
and tools), never ignored. Streamed (vLLM's), the answer comes once the search has ended:
each choice's whole text in one chunk (``answer``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, advance_round
from kvloom.engine.output import CompletionOutput, RequestOutput
from kvloom.server.async_engine import ModelInfo
from kvloom.server.errors import APIError, bad_request, from_value_error
from kvloom.server.generation import Serving, check_context, collect
from kvloom.server.protocol import SamplingRequest
from kvloom.server.responses import SSE_HEADERS, GenerationResponse
from kvloom.server.settings import ServerSettings
from kvloom.server.streams import EngineRequest, ResultStream

# What a beam-search request may set besides its prompt or messages.
_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "ignore_eos", "priority",
    "truncate_prompt_tokens", "cache_salt", "user", "metadata", "service_tier", "store", "use_beam_search",
    "length_penalty", "echo", "add_special_tokens", "skip_special_tokens", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "return_token_ids", "stream", "stream_options"})


def check_beam_request(body: SamplingRequest) -> None:
    """400 for a field that beam search would not honour (a given value other than its
    default or an empty list; ``temperature`` 0, greedy, is what it does anyway)."""
    if body.n > MAX_BEAM_WIDTH:
        raise bad_request(f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}, got {body.n}", "n")
    fields = type(body).model_fields
    for name in sorted(body.model_fields_set - _FIELDS):
        value = getattr(body, name)
        if value in (None, [], {}) or value == fields[name].default or (name == "temperature" and value == 0):
            continue  # not given, in effect
        raise bad_request(f"{name} cannot be used with use_beam_search: beam search keeps the n beams of the "
                          "highest log-probability (ranked with length_penalty) and ends a beam at EOS or "
                          "max_tokens", name)


async def beam_search(serving: Serving, request: Request, request_id: str, prompts: list[list[int]],
                      body: SamplingRequest, max_tokens: int | None, info: ModelInfo,
                      prompt_param: str) -> dict[int, RequestOutput]:
    """Each prompt's ``body.n`` best beams, as the final outputs of choices ``prompt *
    n + rank`` (what the responses build their choices and usage from). ``max_tokens``:
    the request's, or None for the generation config's default (as ``engine_requests``)."""
    width = body.n
    if max_tokens is None:
        max_tokens = info.generation_defaults.get("max_tokens")
    searches: list[BeamSearch] = []
    for token_ids in prompts:
        try:
            params = BeamSearchParams(width, check_context(len(token_ids), max_tokens, info, prompt_param),
                                      body.ignore_eos, body.length_penalty)
        except ValueError as error:
            raise from_value_error(error) from None
        try:
            params.check_max_logprobs(info.limits.max_logprobs)
        except ValueError as error:
            raise from_value_error(error, "n") from None  # the request's beam width
        searches.append(BeamSearch(token_ids, params, info.eos_token_ids))
    cached: list[int] = []  # per prompt: what the cache served its first round (one beam a prompt)
    rounds = 0
    while active := [(index, search) for index, search in enumerate(searches) if not search.done]:
        arrival = time.monotonic()
        requests = [EngineRequest(f"{request_id}-{rounds}-{index}-{beam}", prompt, search.params.round_params(),
                                  body.priority, arrival, cache_salt=body.cache_salt,
                                  lora_request=serving.lora_for(body.model, info))
                    for index, search in active for beam, prompt in enumerate(search.prompts())]
        stream = await serving.open(requests)
        finals = await collect(stream, request)
        if stream.aborted:  # the client went away: no more rounds (its requests are aborted)
            raise APIError(499, "the client closed the connection during the beam search", code="client_disconnected")
        outputs = [finals[position] for position in range(len(requests))]
        if rounds == 0:
            cached = [output.num_cached_tokens for output in outputs]
        advance_round([search for _, search in active], outputs)
        rounds += 1
    results: dict[int, RequestOutput] = {}
    for index, search in enumerate(searches):
        for rank, beam in enumerate(search.best()):
            text = info.tokenizer.decode(beam.output_token_ids, skip_special_tokens=body.skip_special_tokens)
            stop_reason: Any = beam.token_ids[-1] if beam.finish_reason == "stop" else None
            completion = CompletionOutput(rank, text, beam.token_ids, beam.finish_reason, stop_reason)
            results[index * width + rank] = RequestOutput(
                f"{request_id}-{index * width + rank}", None, search.prompt_token_ids, [completion], True,
                num_cached_tokens=cached[index] if rank == 0 else 0)
    return results


def answer(response: GenerationResponse, finals: dict[int, RequestOutput], prompt_lens: list[int],
           body: SamplingRequest, request: Request, settings: ServerSettings) -> JSONResponse | StreamingResponse:
    """The search's beams as the response: whole, or streamed through the one SSE loop,
    each choice's whole output as its one delta (the usage chunk and ``[DONE]`` after)."""
    if not body.stream:
        return JSONResponse(response.full(finals, prompt_lens, body.n))
    stream = ResultStream([finals[index].request_id for index in sorted(finals)], lambda _: None)
    for index in sorted(finals):
        whole = finals[index].outputs[0]
        whole = dataclasses.replace(whole, delta_text=whole.text, delta_token_ids=list(whole.token_ids))
        stream.put((index, dataclasses.replace(finals[index], outputs=[whole])))
    include_usage = body.include_usage_in_stream or settings.force_include_usage
    return StreamingResponse(response.stream(stream, request, prompt_lens, body.n, include_usage,
                                             body.continuous_usage_in_stream),
                             media_type="text/event-stream", headers=SSE_HEADERS)
