"""vLLM's Classification API (``POST /classify``; SGLang's ``/v1/classify``) for a
sequence-classification model: each input's class probabilities, its score head read at
its last token (``SamplingParams.pooling`` "classify") through the model's activation
(engine/classification.py), and the most probable class's label."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from kvloom.engine.classification import class_probabilities
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from kvloom.server.errors import bad_request
from kvloom.server.generation import Serving
from kvloom.server.serving_embeddings import PoolingRequest, pool, pooling_prompts

CLASSIFY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling="classify",
                          output_kind=RequestOutputKind.FINAL_ONLY)


class ClassificationRequest(PoolingRequest):
    # False: the raw logits in ``probs`` (vLLM's field), not the activation's values.
    use_activation: bool = True


async def create_classification(body: ClassificationRequest, request: Request, serving: Serving) -> dict[str, Any]:
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    classifier = info.classifier
    if classifier is None:
        raise bad_request("classification needs a sequence-classification model (a *ForSequenceClassification "
                          "checkpoint); the served model is a causal LM", "model", "model_not_supported")
    prompts = pooling_prompts(body, info, serving.settings)
    response_id, finals = await pool(body, prompts, CLASSIFY, "classify", request, serving, info)
    data = []
    for index in range(len(prompts)):
        logits = finals[index].pooled or []
        probs = class_probabilities(logits, classifier, body.use_activation)
        best = max(range(len(logits)), key=logits.__getitem__)  # the first of equal ones
        data.append({"index": index, "label": classifier.labels[best], "probs": probs,
                     "num_classes": classifier.num_labels})
    tokens = sum(map(len, prompts))
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}
