"""OpenAI's GPT-OSS (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): Llama's layers with
biases on q, k, v and o, attention sinks (a learned logit per query head in each softmax's
denominator: ``config.attention_sinks``, attention/base.py), a sliding window of 128 on
every other layer, YaRN's rotary, and a mixture-of-experts FFN in every layer
(``config.moe``: a router with a bias, the top-k logits softmaxed, experts with biases and
a clamped SwiGLU; models/moe.py runs it).

The checkpoints on the hub store the experts in MXFP4 (``*_blocks``: two 4-bit e2m1
numbers a byte, 32 a block; ``*_scales``: one e8m0 power of two a block): with
config.json's ``quantization_config`` (mxfp4) they stay 4-bit (models/mxfp4_experts.py);
a checkpoint without it has them read back to the model's dtype at load
(``kernels.mxfp4.dequantize_mxfp4``: exact, as every such number is a bf16 one). The layers
run as modules (the native walk runs no sinks, nor experts with biases).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.kernels.mxfp4 import dequantize_mxfp4
from kvloom.models.llama import LlamaForCausalLM

MXFP4_PARTS = ("_blocks", "_scales")


class GptOssForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no GPT-OSS sequence classifier is read
    modules_only = "attention sinks and a mixture-of-experts FFN"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # An MXFP4 checkpoint's experts stay 4-bit (config.moe.mxfp4_experts: SparseMoE holds them so).
        moe = self.config.moe
        super().load_weights(weights if moe is not None and moe.mxfp4_experts else self._dequantized(weights))

    def _dequantized(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each MXFP4 pair, once both halves have come, as the
        tensor it stands for, in the bf16 checkpoints' layout ([E, in, out]: the blocks
        run along the input features of each [out, in] row)."""
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            part = next((p for p in MXFP4_PARTS if name.endswith(p)), None)
            if part is None:
                yield name, tensor
                continue
            base = name.removesuffix(part)
            halves = waiting.setdefault(base, {})
            halves[part] = tensor
            if len(halves) == len(MXFP4_PARTS):
                del waiting[base]
                dtype = self.embed_tokens.weight.dtype
                yield base, dequantize_mxfp4(halves["_blocks"], halves["_scales"], dtype).transpose(1, 2)
        if waiting:
            missing = sorted(f"{base}{p}" for base, halves in waiting.items() for p in MXFP4_PARTS if p not in halves)
            raise ValueError(f"checkpoint has MXFP4 blocks without their scales or scales without blocks: {missing}")
