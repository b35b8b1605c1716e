"""kvloom's own scoring endpoints, for kvloom.lang's ``Endpoint`` backend:

- ``POST /kvloom/score`` ``{"prompt": text, "choices": [text, ...]}`` -> the sum of each
  choice's tokens' log-probabilities after the prompt (``logprobs``), the tokens each
  choice adds (``num_tokens``) and the prompt tokens the prefix cache served for each
  (``cached_tokens``); the choices run as one group (engine/scoring.py: the shared
  prefix is computed once).
- ``GET /kvloom/chat_roles``: the chat template's text before and after a system,
  user and assistant message's content.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import Field

from kvloom.engine.scoring import continuations
from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.generation import Serving, collect, new_id
from kvloom.server.protocol import RequestModel
from kvloom.server.streams import EngineRequest

ROLES = ("system", "user", "assistant")


class ScoreRequest(RequestModel):
    model: str | None = None
    prompt: str
    choices: list[str] = Field(min_length=1, max_length=64)


async def create_score(body: ScoreRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    serving.check_model(body.model, info)
    if not all(body.choices):
        raise bad_request("every choice must be a non-empty string", "choices")
    tokenizer = info.tokenizer
    try:
        wanted = continuations(tokenizer.encode(body.prompt, add_special_tokens=False),
                               [tokenizer.encode(body.prompt + choice, add_special_tokens=False)
                                for choice in body.choices])
        for index, choice in enumerate(wanted):  # the engine would blame "the prompt"
            info.limits.check_prompt(len(choice.token_ids), f"choices[{index}]")
    except ValueError as error:
        raise from_value_error(error) from None
    request_id = new_id("score")
    lora = serving.lora_for(body.model, info)
    finals = await collect(await serving.open([EngineRequest(f"{request_id}-{i}", c.token_ids, c.params,
                                                             lora_request=lora)
                                               for i, c in enumerate(wanted)]), request)
    outputs = [finals[i] for i in range(len(wanted))]
    return {"object": "kvloom.score", "logprobs": [c.logprob(o) for c, o in zip(wanted, outputs, strict=True)],
            "num_tokens": [len(c.token_ids) - c.start for c in wanted],
            "cached_tokens": [o.num_cached_tokens for o in outputs]}


def chat_roles(serving: Serving) -> dict[str, list[str]]:
    tokenizer = serving.model_info().tokenizer
    try:
        return {role: list(tokenizer.role_markers(role)) for role in ROLES}
    except ValueError as error:
        raise bad_request(str(error)) from None
