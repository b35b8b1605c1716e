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


SSM_ARCHITECTURES = ("Mamba2ForCausalLM", "BambaForCausalLM")


@dataclass(frozen=True)
class SSMConfig:
    """Mamba2's state-space mixer (Mamba2, and the Mamba2 layers of the Bamba hybrid).
    Each mixer keeps a fixed-size state per request instead of a growing KV cache: the
    causal convolution's last ``conv_kernel - 1`` inputs, ``[conv_dim, conv_kernel - 1]``,
    and the SSM state, ``[num_heads, head_dim, state_size]``. ``layer_kinds`` says which
    decoder layers are mixers ("mamba") and which attend over the paged KV ("attention")."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int  # B and C are shared by num_heads / num_groups heads each
    conv_kernel: int
    intermediate_size: int  # expand * hidden_size == num_heads * head_dim
    chunk_size: int  # the chunked (SSD) scan's block length
    norm_eps: float  # of the gated RMSNorm after the scan
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    use_conv_bias: bool = True
    use_bias: bool = False  # in_proj and out_proj
    residual_in_fp32: bool = False  # Mamba2 keeps the residual stream in float32
    layer_kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel",
                     "intermediate_size", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ssm config: {name} must be a positive integer, got {value!r}")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(f"ssm config: num_heads * head_dim ({self.num_heads} * {self.head_dim}) must "
                             f"equal the mixer's intermediate size ({self.intermediate_size})")
        if self.num_heads % self.num_groups:
            raise ValueError(f"ssm config: n_groups ({self.num_groups}) must divide num_heads ({self.num_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"ssm config: conv_kernel must be at least 2, got {self.conv_kernel}")
        unknown = set(self.layer_kinds) - {"mamba", "attention"}
        if unknown or "mamba" not in self.layer_kinds:
            raise ValueError(f"ssm config: layer kinds must be 'mamba' or 'attention', at least one "
                             f"'mamba', got {self.layer_kinds}")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: x, then B, then C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "attention")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "mamba")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> SSMConfig | None:
        arch = (hf.get("architectures") or [""])[0]
        if arch not in SSM_ARCHITECTURES:
            return None
        # transformers 5 writes a non-finite float as {"__float__": "Infinity"}.
        limit = tuple(float(v["__float__"] if isinstance(v, dict) else v)
                      for v in (hf.get("time_step_limit") or (0.0, float("inf"))))
        layers = int(hf["num_hidden_layers"])
        hidden = int(hf["hidden_size"])
        if arch == "Mamba2ForCausalLM":
            return cls(num_heads=int(hf["num_heads"]), head_dim=int(hf["head_dim"]),
                       state_size=int(hf["state_size"]), num_groups=int(hf.get("n_groups", 1)),
                       conv_kernel=int(hf.get("conv_kernel", 4)),
                       intermediate_size=int(hf.get("expand", 2) * hidden), chunk_size=int(hf.get("chunk_size", 256)),
                       norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), time_step_limit=(limit[0], limit[1]),
                       use_conv_bias=bool(hf.get("use_conv_bias", True)), use_bias=bool(hf.get("use_bias", False)),
                       residual_in_fp32=bool(hf.get("residual_in_fp32", True)), layer_kinds=("mamba",) * layers)
        attention = set(hf.get("attn_layer_indices") or ())  # Bamba
        heads = int(hf.get("mamba_n_heads", 128))
        intermediate = int(hf.get("mamba_expand", 2) * hidden)
        head_dim = hf.get("mamba_d_head", "auto")
        return cls(num_heads=heads, head_dim=intermediate // heads if head_dim == "auto" else int(head_dim),
                   state_size=int(hf.get("mamba_d_state", 256)), num_groups=int(hf.get("mamba_n_groups", 1)),
                   conv_kernel=int(hf.get("mamba_d_conv", 4)), intermediate_size=intermediate,
                   chunk_size=int(hf.get("mamba_chunk_size", 256)), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                   time_step_limit=(limit[0], limit[1]), use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
                   use_bias=bool(hf.get("mamba_proj_bias", False)),
                   layer_kinds=tuple("attention" if i in attention else "mamba" for i in range(layers)))

    def attention_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``hf`` with what ModelConfig requires of an attention model filled in where a
        pure state-space config (Mamba2) has none: one head of one number stands in for
        the attention shape, which sizes nothing (``ModelConfig.num_kv_layers`` is 0);
        the FFN size is the mixer's; the norms' eps is ``layer_norm_epsilon``."""
        if self.attention_layers or "num_attention_heads" in hf:
            return hf
        return {"num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": self.intermediate_size,
                "rms_norm_eps": self.norm_eps, **hf, "head_dim": 1}
