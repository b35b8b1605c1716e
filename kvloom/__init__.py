"""kvloom: an LLM inference and serving engine with continuous batching over a paged
KV cache, a radix prefix cache and an OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvloom.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig
from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import SamplingParams, ThinkingBudget

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvloom.engine.beam_search import BeamSearchParams
    from kvloom.engine.engine import LLMEngine
    from kvloom.engine.llm import LLM

__all__ = ["LLM", "LLMEngine", "SamplingParams", "ThinkingBudget", "BeamSearchParams", "LoRARequest",
           "StructuredOutput", "StructuredOutputsParams", "EngineConfig", "CacheConfig", "SchedulerConfig",
           "DEFAULT_MODEL", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvloom` (e.g. for the CLI's --help) does not import torch.
    if name == "LLM":
        from kvloom.engine.llm import LLM
        return LLM
    if name in ("StructuredOutput", "StructuredOutputsParams"):
        from kvloom import structured
        return getattr(structured, name)
    if name == "BeamSearchParams":  # lazy too: the engine package sits above the kernels
        from kvloom.engine.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "LLMEngine":
        from kvloom.engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'kvloom' has no attribute {name!r}")
