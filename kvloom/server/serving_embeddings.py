"""POST /v1/embeddings (OpenAI's): each input's embedding from the served decoder model,
the final hidden state of its last token, L2-normalized (vLLM's last-token pooling for
decoder models; SamplingParams.pooling "embed"). ``encoding_format`` "base64" (the OpenAI SDK's
default) sends each vector as little-endian float32 bytes in base64.

``PoolingRequest`` is what every pooling route reads its prompts from (``/classify`` too):
``input`` (texts or token ids), or, as vLLM's chat-shaped embedding and classification
requests, ``messages`` rendered by the chat template into one prompt (no generation prompt
by default: the conversation itself is what is pooled)."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

import torch
from fastapi import Request
from pydantic import model_validator

from kvloom.engine.output import RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.generation import Serving, collect, encode_prompts, new_id, truncate_prompt
from kvloom.server.protocol import ChatMessage, PromptInput, RequestModel
from kvloom.server.serving_chat import encode_chat_request
from kvloom.server.settings import ServerSettings
from kvloom.server.streams import EngineRequest, ModelInfo

EMBED = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling="embed",
                       output_kind=RequestOutputKind.FINAL_ONLY)


class PoolingRequest(RequestModel):
    """The prompts of a pooling request: exactly one of ``input`` (text, a list of texts, a
    list of token ids, or a list of token-id lists; never empty) and ``messages`` (a chat,
    one prompt through the template, with chat's template fields)."""

    model: str | None = None
    input: PromptInput | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    # The tokenizer's special tokens: on an input by default, on a chat (whose template
    # writes its own) not, as vLLM's.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    request_id: str | None = None  # vLLM's: names the response (``<kind>-<request_id>``)
    priority: int = 0

    @model_validator(mode="after")
    def _exactly_one_source(self) -> PoolingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must contain at least one message")
        return self


class EmbeddingRequest(PoolingRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # OpenAI's shortening: matryoshka models only (``_check_dimensions``)


async def create_embedding(body: EmbeddingRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    _check_dimensions(body.dimensions, info)
    prompts = pooling_prompts(body, info, serving.settings)
    _, finals = await pool(body, prompts, EMBED, "embd", request, serving, info)
    data = [{"object": "embedding", "index": index,
             "embedding": encoded(_shortened(finals[index].pooled or [], body.dimensions), body.encoding_format)}
            for index in range(len(prompts))]
    tokens = sum(map(len, prompts))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def pool(body: PoolingRequest, prompts: list[list[int]], params: SamplingParams, prefix: str,
               request: Request, serving: Serving, info: ModelInfo) -> tuple[str, dict[int, RequestOutput]]:
    """Run each prompt as one pooling request of ``params``: the response's id (vLLM's
    ``request_id`` names it, ``<prefix>-<request_id>``, where the body has one) and the
    final outputs by prompt index."""
    response_id = new_id(prefix) if body.request_id is None else f"{prefix}-{body.request_id}"
    engine_id = new_id(response_id)  # two clients' equal request_ids never clash in the engine
    lora = serving.lora_for(body.model, info)
    finals = await collect(await serving.open([
        EngineRequest(f"{engine_id}-{index}", ids, params, body.priority, cache_salt=body.cache_salt,
                      lora_request=lora)
        for index, ids in enumerate(prompts)]), request)
    return response_id, finals


def pooling_prompts(body: PoolingRequest, info: ModelInfo, settings: ServerSettings) -> list[list[int]]:
    """A pooling request's prompts as token ids: its ``input`` (a text, texts, token ids
    or lists of them), or its ``messages`` through the chat template (as chat encodes
    them), each cut to ``truncate_prompt_tokens`` and checked against the context: a 400
    naming the input (``input[i]`` of several) otherwise."""
    given = body.input
    if body.messages is None and (not given or (isinstance(given, list) and any(not item for item in given))):
        raise bad_request("input must not be empty, nor hold an empty text or token list", "input")
    try:
        if body.messages is not None:
            prompts = [encode_chat_request(body, info, settings, None)]
        else:
            assert given is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            prompts, _ = encode_prompts(given, info, special)
        prompts = [truncate_prompt(ids, body.truncate_prompt_tokens, info) for ids in prompts]
        for index, ids in enumerate(prompts):
            info.limits.check_prompt(len(ids), f"input[{index}]" if len(prompts) > 1 else "input")
    except ValueError as error:
        raise from_value_error(error) from None
    return prompts


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as the response sends it: floats, or little-endian float32 in base64."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _check_dimensions(dimensions: int | None, info: ModelInfo) -> None:
    """OpenAI's ``dimensions``, as vLLM serves it: only for a matryoshka model (whose first
    k dimensions are an embedding), and one of its listed sizes where it lists them."""
    if dimensions is None:
        return
    if info.matryoshka_dimensions is None:
        raise bad_request("dimensions is not supported: this model does not support matryoshka representation "
                          "(its config.json sets neither is_matryoshka nor matryoshka_dimensions), and a shortened "
                          "embedding of it would be a poor one", "dimensions")
    if not 0 < dimensions <= info.hidden_size:
        raise bad_request(f"dimensions must be in [1, {info.hidden_size}], got {dimensions}", "dimensions")
    if info.matryoshka_dimensions and dimensions not in info.matryoshka_dimensions:
        raise bad_request(f"dimensions must be one of the model's matryoshka sizes "
                          f"{list(info.matryoshka_dimensions)}, got {dimensions}", "dimensions")


def _shortened(embedding: list[float], dimensions: int | None) -> list[float]:
    """A normalized embedding's first ``dimensions`` values, normalized again (all of it
    for None): what normalizing the hidden state's first ``dimensions`` values gives."""
    if dimensions is None:
        return embedding
    head = torch.tensor(embedding[:dimensions], dtype=torch.float64)
    return torch.nn.functional.normalize(head, dim=0).tolist()
