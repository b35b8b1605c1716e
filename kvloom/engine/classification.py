"""A sequence classifier's answers (``ModelConfig.classifier``): its class logits, read
at an input's last token (``SamplingParams.pooling`` "classify"), turned into
probabilities as vLLM's classify turns them, and a cross-encoder's pair scores (a
classifier of one label reads the query and the document as one input). The server's
``/classify``, ``/score`` and ``/rerank`` (server/serving_classify.py,
server/serving_rerank.py) and ``LLM.classify`` / ``LLM.score`` share these rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvloom.model_families import ClassifierConfig


def class_probabilities(logits: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor,
                        classifier: ClassifierConfig, use_activation: bool = True) -> Any:
    """The classes' probabilities from one input's logits (or from each token's, a list
    of them: the same shape back), in float32: a softmax over the classes, or each
    class's sigmoid for one label or a multi-label model (``ClassifierConfig.activation``).
    ``use_activation`` False: the logits as they are (vLLM's field of that name)."""
    values = torch.as_tensor(logits, dtype=torch.float32)
    if not use_activation:
        return values.tolist()
    return (values.sigmoid() if classifier.activation == "sigmoid" else values.softmax(-1)).tolist()


def cross_encoder_check(classifier: ClassifierConfig | None) -> None:
    """Raise ValueError unless the model scores pairs as a cross-encoder (a classifier
    of one label); an embedding model (no classifier) scores them as a bi-encoder."""
    if classifier is not None and classifier.num_labels != 1:
        raise ValueError(f"scoring pairs needs a cross-encoder (a sequence classifier of one label) or an embedding "
                         f"model; this classifier has {classifier.num_labels} labels: classify its inputs instead")
