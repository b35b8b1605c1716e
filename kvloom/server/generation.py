"""What completions and chat share: request -> engine requests, streams, usage.

An HTTP request with ``k`` prompts and ``n`` samples becomes ``k * n`` engine
requests ``f"{id}-{i}"`` with ``i = prompt_index * n + sample`` (OpenAI's choice
index), fanned out by ``sampling_params.fan_out`` as ``LLM.generate`` fans out:
sample ``s`` of a seeded request uses ``seed + s`` so samples differ but the whole
response is reproducible. The response objects and the SSE loop are in responses.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvloom.engine.admission import RequestRejected
from kvloom.engine.output import RequestOutput, TokenLogprobs
from kvloom.kv_spec import KVExport, KVImport, StagedKV
from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import RequestOutputKind, SamplingParams, fan_out
from kvloom.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    EngineNotReady,
    EngineOverloaded,
    EngineRequest,
    ModelInfo,
    RequestAborted,
    ResultStream,
)
from kvloom.server.errors import SERVER_ERROR, APIError, bad_request, from_value_error, overloaded
from kvloom.server.lora_modules import LoRAModules
from kvloom.server.protocol import SamplingRequest
from kvloom.server.response_store import ResponseStore
from kvloom.server.settings import ServerSettings
from kvloom.structured import structured_output_from_openai

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """The engine and settings, plus the checks every generation endpoint makes."""

    engine: AsyncEngine
    settings: ServerSettings
    loras: LoRAModules = field(init=False)  # the adapters served by name (server/lora_modules.py)
    # The Responses API's stored responses (server/response_store.py); None: nothing is stored.
    responses: ResponseStore | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loras", LoRAModules(self.settings.lora_modules))
        object.__setattr__(self, "responses", ResponseStore() if self.settings.enable_responses_store else None)

    def model_info(self) -> ModelInfo:
        """The loaded model's facts, or a 503 while it loads / after it failed."""
        try:
            self.engine.check_ready()
        except EngineNotReady as error:
            raise overloaded(str(error), code="model_not_ready") from None
        assert self.engine.info is not None
        return self.engine.info

    def served_name(self, info: ModelInfo) -> str:
        return self.settings.model_ids(info.model_name)[0]

    def check_model(self, requested: str | None, info: ModelInfo) -> str:
        """The name to report: the served name, or the LoRA adapter's the request names;
        404 for a model we do not serve."""
        names = self.settings.model_ids(info.model_name)
        adapters = self.loras.names()
        if requested is not None and requested in adapters and requested not in names:
            return requested
        if requested is not None and requested not in names:
            served = ", ".join(repr(n) for n in (names[0], *adapters))
            raise APIError(404, f"The model {requested!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return names[0]

    def lora_for(self, requested: str | None, info: ModelInfo) -> LoRARequest | None:
        """The adapter a request's ``model`` names (after ``check_model``); None: the base."""
        if requested in self.settings.model_ids(info.model_name):
            return None
        return self.loras.request(requested)

    async def open(self, requests: list[EngineRequest]) -> ResultStream:
        if self.settings.log_requests:
            log_requests(requests, self.settings.max_log_len)
        try:
            return await self.engine.generate(requests)
        except EngineOverloaded as error:
            raise overloaded(str(error)) from None
        except EngineNotReady as error:
            raise overloaded(str(error), code="model_not_ready") from None
        except ValueError as error:  # the engine's verdict: this request can never run
            raise from_value_error(error) from None


def log_requests(requests: list[EngineRequest], max_log_len: int | None) -> None:
    """vLLM's request log (--enable-log-requests, --max-log-len): a line per engine
    request, its prompt token ids cut to ``max_log_len``."""
    for request in requests:
        ids = request.prompt_token_ids
        shown = ids if max_log_len is None or len(ids) <= max_log_len else [*ids[:max_log_len], "..."]
        logger.info("Received request %s: prompt_token_ids: %s (%d), params: %s, lora_request: %s",
                    request.request_id, shown, len(ids), request.params, request.lora_request)


def base_params(body: SamplingRequest, settings: ServerSettings, logprobs: int | None,
                info: ModelInfo | None = None) -> SamplingParams:
    """The request's sampling parameters; ``max_tokens`` is settled per prompt later.
    A field the request leaves unset takes the model's generation-config default."""
    check_n_and_store(body, settings)
    if body.length_penalty != 1.0:
        raise bad_request("length_penalty ranks beams: it needs use_beam_search", "length_penalty")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is only returned with stream false (as vLLM)", "prompt_logprobs")
    given = {name: getattr(body, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty") if getattr(body, name) is not None}
    if info is not None:
        defaults = {name: value for name, value in info.generation_defaults.items()
                    if name != "max_tokens"}
        given = {**defaults, **given}
    try:
        structured = structured_output_from_openai(
            body.response_format, guided_json=body.guided_json, guided_regex=body.guided_regex,
            guided_choice=body.guided_choice, guided_grammar=body.guided_grammar,
            guided_json_object=body.guided_json_object, structured_outputs=body.structured_outputs)
        params = SamplingParams(
            n=body.n, seed=body.seed, max_tokens=None, min_tokens=body.min_tokens,
            stop=[] if body.stop is None else body.stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, structured=structured,
            logit_bias=body.logit_bias, allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or [], skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, prompt_logprobs=body.prompt_logprobs,
            prompt_logprobs_start=body.prompt_logprobs_start or 0, output_kind=output_kind(body.stream), **given)
    except ValueError as error:
        raise from_value_error(error) from None
    check_logprobs(params, info)  # chat's top_logprobs has had its own check, naming that field
    return params


def check_logprobs(params: SamplingParams, info: ModelInfo | None) -> None:
    """The engine's max_logprobs check, as a 400 before anything is queued."""
    if info is None:
        return
    try:
        info.limits.check_logprobs(params.logprobs, "logprobs")
        info.limits.check_logprobs(params.prompt_logprobs, "prompt_logprobs")
    except RequestRejected as error:
        raise from_value_error(error) from None


def check_n_and_store(body: SamplingRequest, settings: ServerSettings) -> None:
    """What every generation checks first, beam search's included."""
    if isinstance(body.n, int) and body.n > settings.max_n:
        raise bad_request(f"n must be <= {settings.max_n}, got {body.n}", "n")
    if body.store:
        raise bad_request("store=true is not supported: this server keeps no completions "
                          "(send false or leave it out)", "store", "unsupported_parameter")


def output_kind(stream: bool) -> RequestOutputKind:
    """What the engine hands back per step, as vLLM's server asks: a streamed response
    sends each step's new text (DELTA: no cumulative copies of the output so far); a
    full one waits for the end (FINAL_ONLY: no output, no event-loop wake-up and, with
    no stop string, no detokenizing until the request finishes). The metrics count
    tokens from the engine's progress, not from these outputs."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def check_stream_options(body: SamplingRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def engine_requests(request_id: str, prompts: list[list[int]], params: SamplingParams,
                    max_tokens: int | None, info: ModelInfo, priority: int,
                    prompt_param: str, cache_salt: str | None = None,
                    lora: LoRARequest | None = None) -> list[EngineRequest]:
    """One engine request per (prompt, sample), after the context-length checks."""
    if max_tokens is None:
        max_tokens = info.generation_defaults.get("max_tokens")
    arrival = time.monotonic()
    requests: list[EngineRequest] = []
    for prompt_index, token_ids in enumerate(prompts):
        fitted = _fit_to_context(params, len(token_ids), max_tokens, info, prompt_param)
        for sample, sample_params in enumerate(fan_out(fitted)):
            requests.append(EngineRequest(f"{request_id}-{prompt_index * params.n + sample}",
                                          token_ids, sample_params, priority, arrival, cache_salt=cache_salt,
                                          lora_request=lora))
    return requests


def _fit_to_context(params: SamplingParams, prompt_len: int, max_tokens: int | None,
                    info: ModelInfo, prompt_param: str) -> SamplingParams:
    """``params`` with the prompt's max_tokens (``check_context``)."""
    try:
        return dataclasses.replace(params, max_tokens=check_context(prompt_len, max_tokens, info, prompt_param))
    except ValueError as error:
        raise from_value_error(error) from None


def check_context(prompt_len: int, max_tokens: int | None, info: ModelInfo, prompt_param: str) -> int:
    """The engine's admission checks on the prompt, then OpenAI's rule for max_tokens:
    prompt + max_tokens must fit the context (the engine would cap it silently).
    Returns max_tokens, or where the request gives none, what the context leaves."""
    limits = info.limits
    try:
        limits.check_prompt(prompt_len, prompt_param)
    except RequestRejected as error:
        raise from_value_error(error) from None
    if max_tokens is not None:
        if isinstance(max_tokens, int) and prompt_len + max_tokens > limits.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens, but you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                "for the completion); reduce the prompt or max_tokens",
                "max_tokens", "context_length_exceeded")
    else:
        max_tokens = limits.default_max_tokens(prompt_len)
    return max_tokens


def encode_prompts(prompt: Any, info: ModelInfo, special: bool) -> tuple[list[list[int]], list[str]]:
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


def truncate_prompt(token_ids: list[int], keep: int | None, info: ModelInfo) -> list[int]:
    """The engine's ``AdmissionLimits.truncate``, as a 400 naming the field."""
    try:
        return info.limits.truncate(token_ids, keep)
    except RequestRejected as error:
        raise from_value_error(error) from None


def check_token_ids(token_ids: list[int], info: ModelInfo, param: str) -> None:
    """The engine's token-id check, as a 400 before anything is queued."""
    try:
        info.limits.check_token_ids(token_ids, param)
    except RequestRejected as error:
        raise from_value_error(error) from None


# ---- prefill/decode disaggregation --------------------------------------------------------
async def open_with_kv_transfer(serving: Serving, request: Request, requests: list[EngineRequest],
                                kv_params: dict[str, Any] | None, n: int) -> ResultStream | JSONResponse:
    """The generation's stream, with its ``kv_transfer_params`` applied. The prefill
    leg (``{"do_remote_decode": true}``) is answered here: one engine request per
    prompt, ``max_tokens`` 1, whose prompt's KV the instance stages; the JSON answer
    holds, per prompt, where (``{"transfers": [StagedKV...]}``). The decode leg
    (``{"transfers": [...]}``) pulls that KV into each of the prompt's ``n`` samples.
    The engine refuses a leg its ``--role`` does not serve (400)."""
    if kv_params is None:
        return await serving.open(requests)
    prefill = kv_params.get("do_remote_decode") is True
    role = serving.model_info().kv_transfer.get("role")
    if role != ("prefill" if prefill else "decode"):
        raise bad_request(f"this instance serves --role {role}; kv_transfer_params "
                          f"{'asking to stage the KV' if prefill else 'bringing staged KV'} need a --role "
                          f"{'prefill' if prefill else 'decode'} instance", "kv_transfer_params")
    if prefill:
        return await _prefill_leg(serving, request, requests[::n])
    transfers = kv_params.get("transfers")
    num_prompts = len(requests) // n
    if not isinstance(transfers, list) or len(transfers) != num_prompts:
        raise bad_request(f"kv_transfer_params must be {{\"do_remote_decode\": true}} or {{\"transfers\": "
                          f"[...]}} with one entry per prompt ({num_prompts})", "kv_transfer_params")
    try:
        staged = [StagedKV.from_dict(entry) for entry in transfers]
    except (ValueError, TypeError) as error:
        raise bad_request(f"kv_transfer_params: {error}", "kv_transfer_params") from None
    for index, engine_request in enumerate(requests):
        engine_request.kv_transfer = KVImport(staged[index // n], pulls=n)
    return await serving.open(requests)


async def _prefill_leg(serving: Serving, request: Request, requests: list[EngineRequest]) -> JSONResponse:
    for engine_request in requests:
        engine_request.params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        engine_request.kv_transfer = KVExport()
    finals = await collect(await serving.open(requests), request)
    transfers = [finals[index].kv_transfer_params for index in range(len(requests))]
    if any(transfer is None for transfer in transfers):
        raise APIError(500, "the prompt was computed but its KV was not staged", SERVER_ERROR,
                       code="kv_transfer_failed")
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    return JSONResponse({"object": "kvloom.prefill", "kv_transfer_params": {"transfers": transfers},
                         "usage": usage(prompt_lens, 0, sum(f.num_cached_tokens for f in finals.values()))})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_ids(prefix: str, body: SamplingRequest) -> tuple[str, str]:
    """The response's id and its engine requests' base id: for a client's ``request_id``
    (vLLM's field) "<prefix>-<request_id>", the engine's with a suffix of its own (two
    clients' equal ids never clash in the engine); else one fresh id for both."""
    if body.request_id is None:
        fresh = new_id(prefix)
        return fresh, fresh
    public = f"{prefix}-{body.request_id}"
    return public, new_id(public)


# ---- running a group ---------------------------------------------------------------------
@asynccontextmanager
async def abort_on_disconnect(stream: ResultStream, request: Request) -> AsyncIterator[None]:
    """Abort the stream's engine requests when the client goes away, and on any exit
    of the block (finished streams ignore it). The engine frees their blocks between
    two steps."""
    watcher = asyncio.create_task(_abort_when_disconnected(stream, request))
    try:
        yield
    finally:
        watcher.cancel()
        stream.abort()


async def _abort_when_disconnected(stream: ResultStream, request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a broken connection is a gone client too
        pass
    stream.abort()


async def collect(stream: ResultStream, request: Request) -> dict[int, RequestOutput]:
    """Wait for every request of the group; returns the final output per choice index."""
    finals: dict[int, RequestOutput] = {}
    async with abort_on_disconnect(stream, request):
        try:
            async for index, output in stream:
                if output.finished:
                    finals[index] = output
        except EngineFailed as error:
            raise APIError(500, str(error), SERVER_ERROR, code="engine_failed") from None
        except RequestAborted as error:  # shutdown
            raise overloaded(str(error), code="request_aborted") from None
    for output in finals.values():
        check_finished_cleanly(output)
    return finals


def check_finished_cleanly(output: RequestOutput) -> None:
    """400 when the request's own input made it fail mid-generation (its grammar, ...),
    500 for any other unclean end."""
    reason = output.outputs[0].finish_reason
    if reason in ("stop", "length"):
        return
    error = output.error
    if error is not None and error.caused_by_request:
        raise bad_request(error.message, code="generation_failed")
    raise APIError(500, error.message if error else f"the request ended with {reason!r}", SERVER_ERROR,
                   code="generation_failed")


# ---- usage, logprobs --------------------------------------------------------------------
def usage(prompt_lens: list[int], completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    prompt_tokens = sum(prompt_lens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class UsageCounter:
    """Token counts of a streamed group, from the deltas it has seen."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.prompt_lens = prompt_lens
        self.n = n
        self.completion_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}

    def update(self, index: int, output: RequestOutput) -> None:
        self.completion_tokens[index] = (self.completion_tokens.get(index, 0)
                                         + len(output.outputs[0].delta_token_ids))
        if index % self.n == 0:  # prompts count once: take sample 0's cache hit
            self.cached_tokens[index] = output.num_cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return usage(self.prompt_lens, sum(self.completion_tokens.values()),
                     sum(self.cached_tokens.values()))


def top_entries(entry: TokenLogprobs, num: int) -> list[tuple[int, Any]]:
    """The ``num`` most likely alternatives of one position, best first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(token_id, lp) for token_id, lp in ranked if lp.rank <= num][:num]


def token_name(token_id: int, text: str | None, as_id: bool) -> str:
    """How logprobs name a token: its text, or with ``return_tokens_as_token_ids``
    (vLLM's) ``"token_id:<id>"``."""
    return f"token_id:{token_id}" if as_id else text or ""


def sampled_entry(entry: TokenLogprobs) -> tuple[int, Any]:
    # The output processor puts the sampled token first.
    return next(iter(entry.items()))
