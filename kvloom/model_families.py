"""What a model family adds to ``ModelConfig``: the mixture-of-experts FFN (Mixtral,
Qwen2-MoE, DeepSeek) and DeepSeek's multi-head latent attention. Each is a frozen
dataclass read from the HF ``config.json`` by its ``from_hf``, None where the family
does not apply; ModelConfig holds them (``moe``, ``mla``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts FFN: a router picks ``top_k`` of ``num_experts``
    gated MLPs per token and sums their outputs weighted by the routing weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        return None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): every head's K (its non-rotary
    part) and V come from one latent per token, ``kv_lora_rank`` wide, by one shared
    up-projection; the rotary part of K (``qk_rope_head_dim``) is shared by all heads.
    The paged pool stores only those: ``kv_lora_rank + qk_rope_head_dim`` numbers per
    token and layer."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is one projection of the hidden state
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs adjacent elements (DeepSeek) instead of halves
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared when scaled

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token and layer: the latent, then the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig | None:
        arch = (hf.get("architectures") or [""])[0]
        if arch not in MLA_ARCHITECTURES:
            return None
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        scale = (nope + rope) ** -0.5
        rope_params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            mscale_all_dim = rope_params.get("mscale_all_dim", 0)
            factor = float(rope_params.get("factor", 1.0))
            if mscale_all_dim and factor > 1:
                mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scale *= mscale * mscale
        interleave = True if arch == "DeepseekV2ForCausalLM" else bool(hf.get("rope_interleave", True))
        return cls(kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=hf.get("q_lora_rank"),
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(hf["v_head_dim"]),
                   rope_interleave=interleave, softmax_scale=scale)
