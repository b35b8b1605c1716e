"""HF ``architectures[0]`` -> model class, imported lazily; ``CausalLM``, what the
engine and the runner need of any model class."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup

if TYPE_CHECKING:
    from kvloom.models.loader import Checkpoint

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """A decoder over the paged KV pool (an ``nn.Module``; LlamaForCausalLM is one)."""

    def __call__(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                 metadata: Any) -> torch.Tensor:
        """The final hidden states of the batch's tokens, [tokens, hidden]; only the rows
        ``batch.output_rows`` names where it names some (``batch.final_states``)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def weight_slice(self, hf_name: str) -> Any:
        """The ``TensorSlice`` of checkpoint tensor ``hf_name`` this rank holds, or None
        for all of it (always None without tensor parallel)."""
        ...

    def pack_weights(self, matmul: str = "invariant") -> int:
        """Swap the linear layers for the ``matmul`` kernel's; returns how many."""
        ...

    def use_native_stack(self) -> str | None:
        """Walk the decoder layers natively where a forward allows (after packing);
        returns None, or why this model cannot."""
        ...

    def first_layers(self, num_layers: int) -> CausalLM:
        """A model of this one's first ``num_layers`` decoder layers, its final norm and
        its output head, sharing their weights (the self-speculative draft)."""
        ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def eval(self) -> Any: ...

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "MinistralForCausalLM": "kvloom.models.llama:LlamaForCausalLM",  # Mistral's layers, windowed by layer_types
    "SeedOssForCausalLM": "kvloom.models.llama:LlamaForCausalLM",  # Llama's, its o projection's bias its own flag
    "MixtralForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    # ERNIE 4.5 (dense): Llama's layers, its rotary's adjacent pairs regrouped at load (config.interleaved_rotary).
    "Ernie4_5ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    # SmolLM3: Llama's layers, every fourth without rotary (config.no_rope_layers).
    "SmolLM3ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    # Phi-3: Llama's layers, its checkpoint's q/k/v and gate/up already fused as kvloom's.
    "Phi3ForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    # Granite (dense): Llama's layers with four multipliers (model_families.Multipliers).
    "GraniteForCausalLM": "kvloom.models.llama:LlamaForCausalLM",
    "GraniteMoeForCausalLM": "kvloom.models.llama:LlamaForCausalLM",  # and a Mixtral-routed MoE
    "GemmaForCausalLM": "kvloom.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "kvloom.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "kvloom.models.gemma:GemmaForCausalLM",
    "Olmo2ForCausalLM": "kvloom.models.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "kvloom.models.olmo2:Olmo2ForCausalLM",
    "Exaone4ForCausalLM": "kvloom.models.exaone4:Exaone4ForCausalLM",
    "HeliumForCausalLM": "kvloom.models.helium:HeliumForCausalLM",
    "OlmoForCausalLM": "kvloom.models.olmo:OlmoForCausalLM",
    "Starcoder2ForCausalLM": "kvloom.models.starcoder2:Starcoder2ForCausalLM",
    "PhiForCausalLM": "kvloom.models.phi:PhiForCausalLM",
    "GPTNeoXForCausalLM": "kvloom.models.gpt_neox:GPTNeoXForCausalLM",
    "GPT2LMHeadModel": "kvloom.models.gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "kvloom.models.opt:OPTForCausalLM",
    "GPTBigCodeForCausalLM": "kvloom.models.gpt2:GPTBigCodeForCausalLM",
    "NemotronForCausalLM": "kvloom.models.nemotron:NemotronForCausalLM",
    "ArceeForCausalLM": "kvloom.models.arcee:ArceeForCausalLM",
    "GlmForCausalLM": "kvloom.models.llama:LlamaForCausalLM",  # Llama's layers, the rotary config.py reads
    "Glm4ForCausalLM": "kvloom.models.glm:Glm4ForCausalLM",
    "FalconForCausalLM": "kvloom.models.falcon:FalconForCausalLM",
    "OlmoeForCausalLM": "kvloom.models.olmoe:OlmoeForCausalLM",
    "GptOssForCausalLM": "kvloom.models.gpt_oss:GptOssForCausalLM",
    "GPTJForCausalLM": "kvloom.models.gptj:GPTJForCausalLM",
    "CohereForCausalLM": "kvloom.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "kvloom.models.cohere:CohereForCausalLM",
    "StableLmForCausalLM": "kvloom.models.stablelm:StableLmForCausalLM",
    "Mamba2ForCausalLM": "kvloom.models.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": "kvloom.models.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "kvloom.models.bamba:BambaForCausalLM",  # IBM Granite 4.0: Bamba's stack
    "Lfm2ForCausalLM": "kvloom.models.bamba:BambaForCausalLM",  # LiquidAI LFM2: short convolutions for mixers
    "Lfm2MoeForCausalLM": "kvloom.models.bamba:BambaForCausalLM",  # and with sigmoid-routed experts
    "NemotronHForCausalLM": "kvloom.models.nemotron_h:NemotronHForCausalLM",
    "DeepseekV2ForCausalLM": "kvloom.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "kvloom.models.deepseek:DeepseekForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architecture: str) -> Any:
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    module_name, class_name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_model(config: ModelConfig, max_positions: int,
                tp: TensorParallelGroup = SINGLE_PROCESS) -> CausalLM:
    cls = model_class(config.architecture)
    if config.classifier is not None and not getattr(cls, "has_score_head", False):
        served = sorted(name for name in ARCHITECTURES if getattr(model_class(name), "has_score_head", False))
        suffix = "ForTokenClassification" if config.classifier.per_token else "ForSequenceClassification"
        raise UnsupportedArchitecture(
            f"{config.architecture.removesuffix('ForCausalLM')}{suffix} is not supported: "
            f"classifiers are served for the families of {', '.join(served)}")
    model: CausalLM = cls(config, max_positions, tp)
    return model


@contextlib.contextmanager
def checkpoint_initialised() -> Iterator[None]:
    """Modules built here skip the random initialisation of their linear layers (and
    convolutions): every weight is then the checkpoint's (``load_weights`` refuses a
    parameter left unset, models/weights.py), so drawing them first only cost time, 0.6 s
    of the default model's 1.1 s load on two cores. The layers' ``reset_parameters`` are
    switched off for the block: models are built on one thread (ranks are processes)."""
    layers = (nn.Linear, nn.Conv1d)
    saved = [layer.reset_parameters for layer in layers]
    try:
        for layer in layers:
            layer.reset_parameters = _left_to_the_checkpoint  # type: ignore[method-assign]
        yield
    finally:
        for layer, reset in zip(layers, saved, strict=True):
            layer.reset_parameters = reset  # type: ignore[method-assign]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built here hold ``dtype`` from the start: a bf16 model never holds its
    weights in float32 first (gpt-oss-20b's 1.8B non-expert parameters: 3.6 GB less at its
    peak). The same numbers as building in float32 and converting: a checkpoint's tensor is
    rounded once either way, by the copy instead of ``.to``; what a module must keep in
    float32 (a DeepSeek router) it creates so itself. Models are built on one thread."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else saved)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _left_to_the_checkpoint(self: nn.Module) -> None:
    """A layer's weights stay as allocated until the checkpoint's are copied in."""


def load_model(config: ModelConfig, max_positions: int, checkpoint: Checkpoint,
               device: torch.device, dtype: torch.dtype, matmul: str, native_stack: bool,
               tp: TensorParallelGroup = SINGLE_PROCESS) -> CausalLM:
    """Build, fill, move and pack a model as the engine runs it (the target and a
    draft model alike); ``native_stack`` asks for the one-call decoder walk on CPU.
    Under tensor parallel (``tp``) this rank's shard, reading only its slices."""
    if config.classifier is not None and config.classifier.source_tokens:  # the head's rows, by token id
        classifier = config.classifier.with_token_ids(checkpoint.tokenizer.token_to_id)
        config = dataclasses.replace(config, classifier=classifier)
    with checkpoint_initialised(), default_dtype(dtype):
        model = build_model(config, max_positions, tp)
    model.load_weights(checkpoint.weights(model.weight_slice if tp.size > 1 else None))
    model.to(device=device, dtype=dtype)  # in place, as nn.Module.to is
    model.eval()
    model.pack_weights(matmul)
    if native_stack and device.type == "cpu":
        why_not = model.use_native_stack()
        if why_not is not None:
            logger.info("decoder layers run as modules: %s", why_not)
    return model
