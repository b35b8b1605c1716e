"""HF ``architectures[0]`` -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from kvloom.config import ModelConfig

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    module_name, class_name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_model(config: ModelConfig, max_positions: int) -> nn.Module:
    return model_class(config.architecture)(config, max_positions)
