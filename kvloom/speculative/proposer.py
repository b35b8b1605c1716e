"""The proposer seam and its registry, chosen by ``SpeculativeConfig.method``.

A proposer sees requests right after a step has appended their tokens, and returns
for each up to the number of draft tokens asked for: guesses at the tokens that follow
``request.all_token_ids``. It never writes request state (the scheduler keeps the
drafts); any state of its own (a draft model's KV) is keyed by request id and dropped
by ``release``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvloom.config import EngineConfig, ModelConfig
from kvloom.lora.manager import LoRAManager
from kvloom.models.registry import CausalLM
from kvloom.request import Request


class Proposer(Protocol):
    name: str
    # What one draft token costs, in target steps (0 for a lookup; a draft model's
    # forward relative to the target's): the scheduler's acceptance bar rises with it.
    draft_cost: float

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """At most ``num_tokens[i]`` guesses at what follows ``requests[i]``'s tokens
        (fewer, or none, where the proposer has no good guess)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        ...

    def check_integrity(self) -> None:
        """Check the books of whatever the proposer allocates (a draft model's pool)."""
        ...

    def use_adapters(self, lora: LoRAManager) -> None:
        """Guess through each request's LoRA adapter where the proposer runs the target's
        own layers (layer_skip); the others guess as for the base model."""
        ...


@dataclass(frozen=True)
class TargetModel:
    """What a proposer may build on: the engine's configuration and its loaded model."""

    config: EngineConfig
    model: CausalLM
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_blocks: int  # of the target's KV pool; a draft model's pool holds as many tokens


# method -> "module:function" building the proposer from a TargetModel; imported on use.
PROPOSERS: dict[str, str] = {
    "ngram": "kvloom.speculative.ngram:build",
    "draft": "kvloom.speculative.draft_model:build_draft",
    "layer_skip": "kvloom.speculative.draft_model:build_layer_skip",
}


def make_proposer(target: TargetModel) -> Proposer:
    spec = target.config.speculative_config
    if spec is None:
        raise ValueError("speculative_config is not set")
    if spec.method not in PROPOSERS:
        raise ValueError(f"speculative_config.method must be one of {sorted(PROPOSERS)}, got {spec.method!r}")
    module_name, function = PROPOSERS[spec.method].split(":")
    builder: Callable[[TargetModel], Any] = getattr(importlib.import_module(module_name), function)
    proposer: Proposer = builder(target)
    return proposer
