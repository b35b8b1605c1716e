"""SageMaker's ``POST /invocations`` (vLLM's): one route for every task the model serves.
The body's own fields tell which request it is, and it is answered exactly as on that
route: ``messages`` a chat completion (a classification on a sequence classifier), ``prompt``
a completion, ``query`` a rerank,
``text_1`` / ``queries`` / ``data_1`` a score, ``input`` a classification for a sequence
classifier and an embedding otherwise. A body it cannot tell is a 400 naming the fields
it looks for; a body it can is validated as that route's (the same 400s)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvloom.server.errors import bad_request
from kvloom.server.generation import Serving
from kvloom.server.protocol import ChatCompletionRequest, CompletionRequest
from kvloom.server.serving_chat import create_chat_completion
from kvloom.server.serving_classify import ClassificationRequest, create_classification
from kvloom.server.serving_completions import create_completion
from kvloom.server.serving_embeddings import EmbeddingRequest, create_embedding
from kvloom.server.serving_rerank import RerankRequest, SimilarityScoreRequest, create_rerank, create_similarity_score

Handler = Callable[[Any, Request, Serving], Awaitable[Any]]

# (a field that names the request, its model, its handler), tried in this order.
_BY_FIELD: tuple[tuple[str, type[BaseModel], Handler], ...] = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("query", RerankRequest, create_rerank),
    ("text_1", SimilarityScoreRequest, create_similarity_score),
    ("queries", SimilarityScoreRequest, create_similarity_score),
    ("data_1", SimilarityScoreRequest, create_similarity_score),
)


async def invoke(request: Request, serving: Serving) -> Any:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body could not be read as JSON", None) from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}", None)
    model, handler = _route(body, serving)
    try:
        parsed = model.model_validate(body)
    except ValidationError as error:  # as the route itself reports it: positions under "body"
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None
    return await handler(parsed, request, serving)


def _route(body: dict[str, Any], serving: Serving) -> tuple[type[BaseModel], Handler]:
    if "messages" in body and serving.model_info().classifier is not None:  # a classifier's chat: classified
        return ClassificationRequest, create_classification
    for field, model, handler in _BY_FIELD:
        if field in body:
            return model, handler
    if "input" in body:
        if serving.model_info().classifier is not None:
            return ClassificationRequest, create_classification
        return EmbeddingRequest, create_embedding
    raise bad_request("the body is none of the requests /invocations serves: it has none of messages (chat), "
                      "prompt (completions), input (embeddings, or a classifier's classify), query (rerank), "
                      "text_1, queries or data_1 (score)", None)
