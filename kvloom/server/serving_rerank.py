"""vLLM's Score API (``POST /score``, ``/v1/score``) and Rerank API (``POST /rerank``,
``/v1/rerank``, ``/v2/rerank``: Jina's and Cohere's shape). A causal LM is scored as an
embedding model, a bi-encoder: each text is embedded on its own (the final hidden state
of its last token, as ``/v1/embeddings``) and a pair's score is the cosine of the two
embeddings (engine/similarity.py); a text embedded twice in one request (a query scored
against many documents) is computed once. A sequence classifier of one label is a
cross-encoder: each pair is one input (the tokenizer's pair template,
``Tokenizer.encode_pair``) and its score the sigmoid of the classifier's logit
(engine/classification.py).

A cross-encoder served with ``--chat-template`` scores each pair through it as vLLM's
score template: the template renders ``[{"role": "query"}, {"role": "document"}]`` with
``chat_template_kwargs`` (and ``instruction``) as its variables (Qwen3-Reranker's
prompt, say). Text only: vLLM's multimodal content parts, and a score template's fields
where there is none, are refused by name."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from kvloom.engine.classification import class_probabilities, cross_encoder_check
from kvloom.engine.similarity import cosine_scores, pair_up
from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.generation import Serving, collect, new_id
from kvloom.server.protocol import RequestModel
from kvloom.server.serving_classify import CLASSIFY
from kvloom.server.serving_embeddings import EMBED
from kvloom.server.streams import EngineRequest, ModelInfo

Texts = str | list[str]


class _SimilarityRequest(RequestModel):
    """The fields Score and Rerank share (vLLM's pooling and scoring request mixins)."""

    model: str | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0
    # Each text's prompt cut to k tokens (-1: max_model_len): its last k (truncation_side
    # "left", the default here as for /v1/embeddings) or its first k ("right").
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Each query's / document's text cut to its first k tokens before it is encoded (0: whole).
    max_tokens_per_query: int = Field(default=0, ge=0)
    max_tokens_per_doc: int = Field(default=0, ge=0)
    # A cross-encoder's activation (None: on): False scores a pair by the classifier's raw
    # logit. A cosine is the same with or without the normalization: for a bi-encoder it
    # changes nothing (accepted as vLLM accepts it).
    use_activation: bool | None = None
    # A score template's variables (_score_template): instruction is chat_template_kwargs'
    # "instruction" (an explicit key there wins, as vLLM merges them).
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    padding: str | None = None


class SimilarityScoreRequest(_SimilarityRequest):
    """One pair of sides, under any of vLLM's names for them (exactly one pair)."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None


class RerankRequest(_SimilarityRequest):
    query: str
    documents: Texts
    top_n: int = Field(default=0, ge=0)  # the best n results (0: every document)


_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


def _score_sides(body: SimilarityScoreRequest) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
    """The request's two sides: each one's field name and texts."""
    given = [(first, second) for first, second in _SIDES
             if getattr(body, first) is not None and getattr(body, second) is not None]
    named = {name for pair in _SIDES for name in pair if getattr(body, name) is not None}
    if len(given) != 1 or named != set(given[0]):
        raise bad_request("give the two sides as one pair of fields: text_1 and text_2, queries and documents, "
                          f"queries and items, or data_1 and data_2 (got {sorted(named) or 'none'})", None)
    first, second = given[0]
    return (first, _as_texts(getattr(body, first), first)), (second, _as_texts(getattr(body, second), second))


def _as_texts(value: Texts, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if any(text == "" for text in texts):
        raise bad_request(f"{param} must not hold an empty text (it has no token to embed)", param)
    return texts


# Variables a score template does not take from the request: the renderer sets them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                                          "chat_template", "tools", "documents", "tokenize"})


def _score_template(body: _SimilarityRequest, info: ModelInfo) -> tuple[str, dict[str, Any]] | None:
    """The score template and its variables for each pair, or None where pairs are read
    without one (a 400 naming a template's field then)."""
    if body.padding is not None:
        raise bad_request("padding is not supported: each pair is one input, padded by nothing", "padding",
                          "unsupported_parameter")
    if info.score_template is None or info.classifier is None:
        how = ("a cross-encoder, each pair as the tokenizer's pair of texts (serve it with --chat-template for "
               "a score template)" if info.classifier is not None else "a bi-encoder (the cosine of two embeddings)")
        for name in ("instruction", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise bad_request(f"{name} is read by a score template; this model is scored as {how}, with none",
                                  name, "unsupported_parameter")
        return None
    variables = dict(body.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & variables.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the score template's "
                          "renderer sets them", "chat_template_kwargs")
    if body.instruction is not None:
        variables.setdefault("instruction", body.instruction)
    return info.score_template, variables


def _response_id(prefix: str, body: _SimilarityRequest) -> str:
    """vLLM's ``request_id`` names the response; a fresh id otherwise."""
    return new_id(prefix) if body.request_id is None else f"{prefix}-{body.request_id}"


async def _scores(body: _SimilarityRequest, response_id: str, first: tuple[str, list[str]],
                  second: tuple[str, list[str]], serving: Serving, info: ModelInfo,
                  request: Request) -> tuple[list[float], int]:
    """Each pair's score, in the second side's order, and the prompt tokens computed.
    ``first`` and ``second``: each side's field name and texts."""
    template = _score_template(body, info)
    try:
        pairs = pair_up(len(first[1]), len(second[1]))
    except ValueError as error:
        raise bad_request(str(error), second[0]) from None
    try:
        cross_encoder_check(info.classifier)
    except ValueError as error:
        raise bad_request(str(error), "model", "model_not_supported") from None
    queries = [_cut(text, body.max_tokens_per_query, "max_tokens_per_query", info) for text in first[1]]
    documents = [_cut(text, body.max_tokens_per_doc, "max_tokens_per_doc", info) for text in second[1]]
    if info.classifier is not None:  # a cross-encoder: one input per pair
        try:
            encoded = [info.tokenizer.encode_pair(queries[i], documents[j]) if template is None
                       else info.tokenizer.encode_score_pair(queries[i], documents[j], template[0], **template[1])
                       for i, j in pairs]
        except ValueError as error:  # the template's own refusal (raise_exception) or failure
            raise bad_request(str(error), "chat_template_kwargs" if template and template[1] else None) from None
        prompts = [_fitted(ids, body, info, second[0]) for ids in encoded]
        params = CLASSIFY
    else:  # a bi-encoder: one input per text
        prompts = ([_fitted(info.tokenizer.encode(text), body, info, first[0]) for text in queries]
                   + [_fitted(info.tokenizer.encode(text), body, info, second[0]) for text in documents])
        params = EMBED
    engine_id = new_id(response_id)  # two clients' equal request_ids never clash in the engine
    lora = serving.lora_for(body.model, info)
    finals = await collect(await serving.open([
        EngineRequest(f"{engine_id}-{index}", ids, params, body.priority, lora_request=lora)
        for index, ids in enumerate(prompts)]), request)
    pooled = [finals[index].pooled or [] for index in range(len(prompts))]
    if info.classifier is not None:
        scores = [class_probabilities(logits, info.classifier, body.use_activation is not False)[0]
                  for logits in pooled]
    else:
        scores = cosine_scores(pooled[:len(first[1])], pooled[len(first[1]):], pairs)
    return scores, sum(map(len, prompts))


def _cut(text: str, max_tokens: int, max_param: str, info: ModelInfo) -> str:
    """A text cut to its first ``max_tokens`` tokens as text (vLLM's rule, at a token's
    character boundary; 0: whole)."""
    limit = info.limits.max_model_len
    if max_tokens >= limit:
        raise bad_request(f"{max_param} ({max_tokens}) must be less than max_model_len ({limit})", max_param)
    return truncated_text(info.tokenizer, text, max_tokens) if max_tokens else text


def _fitted(ids: list[int], body: _SimilarityRequest, info: ModelInfo, param: str) -> list[int]:
    """An input's ids (encoded with the special tokens) cut to ``truncate_prompt_tokens``
    and checked against the context."""
    try:
        ids = info.limits.truncate(ids, body.truncate_prompt_tokens, keep_first=body.truncation_side == "right")
        info.limits.check_prompt(len(ids), param)
    except ValueError as error:
        raise from_value_error(error) from None
    return ids


def truncated_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """``text`` up to the end of its ``max_tokens``-th token (without special tokens),
    cut where that token's characters end; again while the cut text still encodes to
    more (a merge can change at the cut)."""
    while text:
        encoding = tokenizer.backend.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= max_tokens:
            break
        end = min(encoding.offsets[max_tokens - 1][1], encoding.offsets[max_tokens][0])
        text = text[:min(end, len(text) - 1)]
    return text


async def create_similarity_score(body: SimilarityScoreRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    first, second = _score_sides(body)
    response_id = _response_id("score", body)
    scores, tokens = await _scores(body, response_id, first, second, serving, info, request)
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


async def create_rerank(body: RerankRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    documents = _as_texts(body.documents, "documents")
    response_id = _response_id("rerank", body)
    scores, tokens = await _scores(body, response_id, ("query", _as_texts(body.query, "query")),
                                   ("documents", documents), serving, info, request)
    ranked = sorted(range(len(documents)), key=lambda index: scores[index], reverse=True)  # stable: ties by index
    if body.top_n:
        ranked = ranked[:body.top_n]
    return {"id": response_id, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [{"index": index, "document": {"text": documents[index], "multi_modal": None},
                         "relevance_score": scores[index]} for index in ranked]}
