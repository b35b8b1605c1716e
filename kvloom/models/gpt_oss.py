"""OpenAI's GPT-OSS (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): Llama's layers with
biases on q, k, v and o, attention sinks (a learned logit per query head in each softmax's
denominator: ``config.attention_sinks``, attention/base.py), a sliding window of 128 on
every other layer, YaRN's rotary, and a mixture-of-experts FFN in every layer
(``config.moe``: a router with a bias, the top-k logits softmaxed, experts with biases and
a clamped SwiGLU; models/moe.py runs it).

The checkpoints on the hub store the experts in MXFP4 (``*_blocks``: two 4-bit e2m1
numbers a byte, 32 a block; ``*_scales``: one e8m0 power of two a block); they are read
back to the model's dtype at load (``dequantize_mxfp4``: exact, as every such number is a
bf16 one). The layers run as modules (the native walk runs no experts and no sinks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.sharding import TensorSlice

# The 16 values of an e2m1 nibble (sign, two exponent bits, one mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_PARTS = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., groups, 16] uint8 and ``scales`` [..., groups] uint8 ->
    [..., groups * 32] of ``dtype``: byte b of a group holds numbers 2b (low nibble) and
    2b + 1 (high nibble), each times 2 ** (scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         "blocks must be [..., groups, 16] and scales [..., groups]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)  # [..., g, 16, 2]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1).float())  # [..., groups, 32]
    return values.flatten(-2).to(dtype)


class GptOssForCausalLM(LlamaForCausalLM):
    has_score_head = False  # no GPT-OSS sequence classifier is read
    modules_only = "attention sinks and a mixture-of-experts FFN"

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        # An MXFP4 pair is cut as the tensor it stands for (only ever along the experts, its first dimension).
        for part in MXFP4_PARTS:
            if hf_name.endswith(part):
                return super().weight_slice(hf_name.removesuffix(part))
        return super().weight_slice(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._dequantized(weights))

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
