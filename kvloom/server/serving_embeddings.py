"""POST /v1/embeddings (OpenAI's): each input's embedding from the served decoder model,
the final hidden state of its last token, L2-normalized (vLLM's last-token pooling for
decoder models; SamplingParams.embed). ``encoding_format`` "base64" (the OpenAI SDK's
default) sends each vector as little-endian float32 bytes in base64."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from kvloom.sampling_params import RequestOutputKind, SamplingParams
from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.generation import Serving, collect, encode_prompts, new_id, truncate_prompt
from kvloom.server.protocol import PromptInput, RequestModel
from kvloom.server.streams import EngineRequest

EMBED = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=True,
                       output_kind=RequestOutputKind.FINAL_ONLY)


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: PromptInput = Field(description="Text, a list of texts, a list of token ids, or a list of "
                                           "token-id lists; never empty.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # OpenAI's shortening: refused (the model's size only)
    user: str | None = None
    # vLLM's: keep only the input's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


async def create_embedding(body: EmbeddingRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    if body.dimensions is not None:
        raise bad_request("dimensions is not supported: an embedding has the model's hidden size", "dimensions")
    if not body.input or (isinstance(body.input, list) and any(not item for item in body.input)):
        raise bad_request("input must not be empty, nor hold an empty text or token list", "input")
    try:
        prompts, _ = encode_prompts(body.input, info, body.add_special_tokens)
        prompts = [truncate_prompt(ids, body.truncate_prompt_tokens, info) for ids in prompts]
        for index, ids in enumerate(prompts):
            info.limits.check_prompt(len(ids), f"input[{index}]" if len(prompts) > 1 else "input")
    except ValueError as error:
        raise from_value_error(error) from None
    request_id = new_id("embd")
    lora = serving.lora_for(body.model, info)
    finals = await collect(await serving.open([
        EngineRequest(f"{request_id}-{i}", ids, EMBED, cache_salt=body.cache_salt, lora_request=lora)
        for i, ids in enumerate(prompts)]), request)
    data = [{"object": "embedding", "index": index,
             "embedding": _encoded(finals[index].embedding or [], body.encoding_format)}
            for index in range(len(prompts))]
    tokens = sum(map(len, prompts))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
