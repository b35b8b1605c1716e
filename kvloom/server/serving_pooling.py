"""vLLM's generic Pooling API (``POST /pooling``): each input's pooled output for a
task (vLLM's pooling tasks, ``SamplingParams.pooling``): "embed" (the last token's final
hidden state, normalized: ``/v1/embeddings``'s), "classify" (a sequence classifier's
class probabilities: ``/classify``'s), "token_embed" (every prompt token's state,
normalized) and "token_classify" (a classifier's probabilities at every token). The
default is the model's own: "token_classify" for a token classifier, "classify" for a
sequence classifier, "token_embed" for a causal LM (every hidden state, what ``/pooling``
has always answered)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request

from kvloom.engine.classification import class_probabilities
from kvloom.sampling_params import POOLING_TASKS, RequestOutputKind, SamplingParams
from kvloom.server.errors import bad_request
from kvloom.server.generation import Serving
from kvloom.server.serving_embeddings import PoolingRequest, encoded, pool, pooling_prompts
from kvloom.server.streams import ModelInfo


class PoolingApiRequest(PoolingRequest):
    task: str | None = None  # one of POOLING_TASKS; None: the model's own (``default_task``)
    encoding_format: Literal["float", "base64"] = "float"
    # The classify tasks' activation (softmax over the classes, or each one's sigmoid);
    # False: the logits themselves (vLLM's field).
    use_activation: bool = True


def default_task(info: ModelInfo) -> str:
    if info.classifier is None:
        return "token_embed"
    return "token_classify" if info.classifier.per_token else "classify"


async def create_pooling(body: PoolingApiRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    task = body.task or default_task(info)
    if task not in POOLING_TASKS:
        raise bad_request(f"task must be one of {', '.join(POOLING_TASKS)}, got {task!r}", "task")
    classifier = info.classifier
    if task in ("classify", "token_classify") and classifier is None:
        raise bad_request(f"task {task!r} needs a classification model; the served model is a causal LM", "task",
                          "model_not_supported")
    if task == "classify" and classifier is not None and classifier.per_token:
        raise bad_request("the served model is a token classifier: it classifies each token (task "
                          "'token_classify'), not the whole input", "task", "model_not_supported")
    prompts = pooling_prompts(body, info, serving.settings)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=task,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    response_id, finals = await pool(body, prompts, params, "pool", request, serving, info)
    data = []
    for index in range(len(prompts)):
        pooled: Any = finals[index].pooled or []
        if task in ("classify", "token_classify"):
            assert classifier is not None
            pooled = class_probabilities(pooled, classifier, body.use_activation)  # each row's (token's) own
        value: Any = ([encoded(row, body.encoding_format) for row in pooled] if task.startswith("token_")
                      else encoded(pooled, body.encoding_format))
        data.append({"index": index, "object": "pooling", "data": value})
    tokens = sum(map(len, prompts))
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}
