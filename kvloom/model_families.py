"""What a model family adds to ``ModelConfig``: the mixture-of-experts FFN (Mixtral,
Qwen2-MoE, DeepSeek), DeepSeek's multi-head latent attention, Mamba2's state-space
mixers, and a sequence classifier's head. Each is a frozen dataclass read from the HF
``config.json`` by its ``from_hf``, None where the family does not apply; ModelConfig
holds them (``moe``, ``mla``, ``ssm``, ``classifier``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


# How router logits become the chosen experts' weights: "softmax" / "sigmoid" score every
# expert, then pick; "topk_softmax" (GPT-OSS) picks the top-k logits, then softmaxes them
# in the activation dtype.
MOE_SCORINGS = ("softmax", "sigmoid", "topk_softmax")
# The experts' activation on their gate/up output: "silu" (SwiGLU), "swigluoai" (GPT-OSS's,
# vLLM's name: gate clamped above and up on both sides at swiglu_limit, then
# (up + 1) * gate * sigmoid(swiglu_alpha * gate)); or, where the experts are not gated (MoEConfig.gated
# False: up alone), "relu2" on it (NVIDIA Nemotron 3's squared ReLU).
MOE_ACTIVATIONS = ("silu", "swigluoai", "relu2")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts FFN: a router picks ``top_k`` of ``num_experts``
    gated MLPs per token and sums their outputs weighted by the routing weights.

    The fields say how each family routes, exactly as transformers 5.24 computes it
    (models/moe.py runs it): Mixtral (softmax, top-k, renormalised), Qwen2-MoE
    (softmax, top-k, ``norm_topk_prob``, a shared expert scaled by a sigmoid gate),
    DeepSeek-V2 (softmax in float32, greedy or group-limited top-k, scaled) and
    DeepSeek-V3 (sigmoid, a bias that steers the choice only, groups by their top-2
    sum, renormalised, scaled) and GPT-OSS (a router with a bias, softmax over the top-k
    logits, experts with biases and a clamped SwiGLU). Layers outside ``sparse_layers``
    keep the dense MLP of ``ModelConfig.intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    sparse_layers: tuple[int, ...]  # the decoder layers whose FFN is this MoE, ascending
    scoring: str = "softmax"  # router logits -> scores: "softmax" or "sigmoid"
    # How the top_k experts are chosen: "greedy" (the top_k scores), "group_limited_greedy"
    # (only within the topk_groups groups of best single score), "noaux_tc" (scores plus
    # score_correction_bias, within the groups of best top-2 sum; weights from the raw scores).
    topk_method: str = "greedy"
    norm_topk_prob: bool = False  # divide the chosen weights by their sum
    routed_scaling_factor: float = 1.0  # multiplies the chosen weights (after any norm)
    num_groups: int = 1  # experts form num_groups equal groups (group-limited methods)
    topk_groups: int = 1  # groups a token may choose from
    score_correction_bias: bool = False  # a per-expert float32 bias added for selection (V3)
    router_float32: bool = False  # router weight kept and applied in float32 (DeepSeek)
    # The guard added to the renormalising sum of sigmoid scores: DeepSeek-V3's 1e-20, LFM2-MoE's 1e-6.
    norm_topk_eps: float = 1e-20
    # Qwen2-MoE rounds the routing weights to the activation dtype before they scale the
    # expert outputs; the others scale in float32 and round the product.
    round_routing_weights: bool = False
    shared_expert_intermediate_size: int = 0  # a shared MLP every token runs; 0: none
    shared_expert_gate: bool = False  # the shared MLP's output times sigmoid(x @ gate) (Qwen2-MoE)
    hidden_act: str = "silu"  # the experts' activation, one of MOE_ACTIVATIONS
    # The experts (and the shared expert) gated, gate and up ([experts, 2 * inter, hidden]), or up alone
    # through hidden_act ([experts, inter, hidden]: Nemotron 3's).
    gated: bool = True
    swiglu_alpha: float = 1.702  # swigluoai's sigmoid gain
    swiglu_limit: float = 7.0  # swigluoai's clamp
    router_bias: bool = False  # the router's logits have a bias (GPT-OSS)
    expert_biases: bool = False  # every expert's gate/up and down projections have biases (GPT-OSS)
    # The checkpoint's fused experts as GPT-OSS stores them: gate_up [experts, hidden,
    # 2 * inter] with gate and up columns alternating, down [experts, inter, hidden]
    # (transformers 5's other fused experts are [experts, 2 * inter, hidden] gate | up and
    # [experts, hidden, inter]).
    gpt_oss_layout: bool = False
    # The checkpoint's routed experts are MXFP4 (config.json's quantization_config, quant_method
    # "mxfp4": GPT-OSS's hub checkpoints): held 4-bit, each matmul dequantizing as it goes
    # (kernels/mxfp4.py), where that kernel runs (a CPU); dequantized at load elsewhere.
    mxfp4_experts: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe config: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe config: num_experts_per_tok ({self.top_k}) exceeds the "
                             f"number of experts ({self.num_experts})")
        if self.scoring not in MOE_SCORINGS:
            raise ValueError(f"moe config: scoring_func must be one of {MOE_SCORINGS}, got {self.scoring!r}")
        if self.topk_method not in MOE_TOPK_METHODS:
            raise ValueError(f"moe config: topk_method must be one of {MOE_TOPK_METHODS}, "
                             f"got {self.topk_method!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"moe config: n_group ({self.num_groups}) must divide the "
                             f"{self.num_experts} experts and be at least topk_group ({self.topk_groups})")
        if self.topk_method == "noaux_tc" and (self.scoring != "sigmoid" or self.num_experts // self.num_groups < 2):
            raise ValueError("moe config: topk_method 'noaux_tc' needs sigmoid scoring and at least "
                             "2 experts per group (groups are ranked by their top-2 sum)")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("moe config: shared_expert_intermediate_size must be >= 0, "
                             f"got {self.shared_expert_intermediate_size}")
        if self.hidden_act not in MOE_ACTIVATIONS or (self.hidden_act == "relu2") == self.gated:
            raise ValueError(f"moe config: the experts' activation must be one of {MOE_ACTIVATIONS} (relu2 for "
                             f"experts without a gate, the others gated), got {self.hidden_act!r} "
                             f"({'gated' if self.gated else 'not gated'})")
        if self.hidden_act == "swigluoai" and not self.swiglu_limit > 0:
            raise ValueError(f"moe config: swiglu_limit must be positive, got {self.swiglu_limit}")

    def is_sparse(self, layer_index: int) -> bool:
        """Whether decoder layer ``layer_index`` runs this MoE (else the dense MLP)."""
        return layer_index in self.sparse_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig | None:
        """The MoE of a Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoe (and Granite 4.0's hybrid),
        DeepSeek-V2/V3 or GPT-OSS ``config.json`` (HF's defaults where a key is absent); None for
        any other architecture, or one without a sparse layer."""
        arch = (hf.get("architectures") or [""])[0]
        layers = range(int(hf.get("num_hidden_layers", 0)))
        act = str(hf.get("hidden_act", "silu"))
        config: MoEConfig
        if arch == "MixtralForCausalLM":
            config = cls(num_experts=int(hf.get("num_local_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
                         intermediate_size=int(hf["intermediate_size"]), sparse_layers=tuple(layers),
                         norm_topk_prob=True, hidden_act=act)
        elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            # Qwen3-MoE routes as Qwen2-MoE (transformers' routers are the same code) and
            # has no shared expert; the defaults are each config class's.
            qwen3 = arch == "Qwen3MoeForCausalLM"
            # The hub's config.json says num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts.
            num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 128 if qwen3 else 60)))
            dense = set(hf.get("mlp_only_layers") or ())
            step = int(hf.get("decoder_sparse_step", 1))
            sparse = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
            if not sparse:
                return None
            shared = 0 if qwen3 else int(hf.get("shared_expert_intermediate_size", 5632))
            config = cls(num_experts=num_experts, top_k=int(hf.get("num_experts_per_tok", 8 if qwen3 else 4)),
                         intermediate_size=int(hf.get("moe_intermediate_size", 768 if qwen3 else 1408)),
                         sparse_layers=sparse, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                         round_routing_weights=True, shared_expert_intermediate_size=shared,
                         shared_expert_gate=not qwen3, hidden_act=act)
        elif arch == "OlmoeForCausalLM":  # Qwen2-MoE's router (softmax in float32, top-k, rounded), no shared expert
            config = cls(num_experts=int(hf.get("num_experts", 64)), top_k=int(hf.get("num_experts_per_tok", 8)),
                         intermediate_size=int(hf["intermediate_size"]), sparse_layers=tuple(layers),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)), round_routing_weights=True,
                         hidden_act=act)
        elif arch == "GraniteMoeForCausalLM":
            # Its router's softmax over the top-k logits is Mixtral's renormalised top-k of the
            # softmax over all of them; the weights rounded to the activation dtype, as HF's.
            config = cls(num_experts=int(hf.get("num_local_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
                         intermediate_size=int(hf["intermediate_size"]), sparse_layers=tuple(layers),
                         norm_topk_prob=True, round_routing_weights=True, hidden_act=act)
        elif arch == GRANITE_HYBRID:
            # GraniteMoe's routing beside a shared MLP every token runs (``shared_mlp``, not
            # gated); with no experts (most Granite 4.0 models) the shared MLP is a dense FFN.
            num_experts = int(hf.get("num_local_experts", 8))  # transformers' default
            if num_experts == 0:
                return None
            config = cls(num_experts=num_experts, top_k=int(hf.get("num_experts_per_tok", 2)),
                         intermediate_size=int(hf["intermediate_size"]), sparse_layers=tuple(layers),
                         norm_topk_prob=True, round_routing_weights=True, hidden_act=act,
                         shared_expert_intermediate_size=int(hf.get("shared_intermediate_size", 1024)))
        elif arch == "Lfm2MoeForCausalLM":
            # Sigmoid scores; a float32 per-expert bias steers the choice only (DeepSeek-V3's
            # noaux_tc in one group); the first num_dense_layers layers dense.
            biased = bool(hf.get("use_expert_bias", True))
            config = cls(num_experts=int(hf.get("num_experts", 32)), top_k=int(hf.get("num_experts_per_tok", 4)),
                         intermediate_size=int(hf.get("moe_intermediate_size", 1792)),
                         sparse_layers=tuple(i for i in layers if i >= int(hf.get("num_dense_layers", 2))),
                         scoring="sigmoid", topk_method="noaux_tc" if biased else "greedy",
                         norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                         routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                         score_correction_bias=biased, norm_topk_eps=1e-6, round_routing_weights=True,
                         hidden_act=act)
        elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
            config = _deepseek_moe(cls, hf, arch == "DeepseekV3ForCausalLM", layers, act)
        elif arch == "NemotronHForCausalLM":
            # Nemotron 3's MoE blocks: DeepSeek-V3's router (float32, sigmoid, the bias steering the
            # choice within the best groups, renormalised with its 1e-20 guard, scaled), experts and a
            # shared expert of up and down alone through mlp_hidden_act (its NemotronHTopkRouter,
            # NemotronHExperts, NemotronHMLP). A latent projection around the experts (moe_latent_size,
            # Nemotron 3 Super's) is refused.
            moe_blocks = tuple(i for i, name in enumerate(nemotron_h_block_names(hf)) if name in ("E", "moe"))
            if not moe_blocks:
                return None
            if hf.get("moe_latent_size") is not None:
                raise ValueError(f"moe config: Nemotron-H's latent MoE projection (moe_latent_size "
                                 f"{hf['moe_latent_size']}) is not supported")
            config = cls(num_experts=int(hf.get("n_routed_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
                         intermediate_size=int(hf.get("moe_intermediate_size", 7688)), sparse_layers=moe_blocks,
                         scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                         routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                         num_groups=int(hf.get("n_group", 1)), topk_groups=int(hf.get("topk_group", 1)),
                         score_correction_bias=True, router_float32=True, norm_topk_eps=1e-20,
                         shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size", 7688)),
                         hidden_act=str(hf.get("mlp_hidden_act", "relu2")), gated=False)
        elif arch == "GptOssForCausalLM":
            # Every layer sparse; the top-k logits softmaxed in the activation dtype (its
            # GptOssTopKRouter), the weights then scale each expert's output in that dtype.
            # (The hub's config.json says experts_per_token too; config.json's hidden_act names
            # no activation the experts use.)
            config = cls(num_experts=int(hf.get("num_local_experts", 128)),
                         top_k=int(hf.get("num_experts_per_tok", hf.get("experts_per_token", 4))),
                         intermediate_size=int(hf.get("intermediate_size", 2880)), sparse_layers=tuple(layers),
                         scoring="topk_softmax", round_routing_weights=True, hidden_act="swigluoai",
                         swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(hf.get("swiglu_limit", 7.0)), router_bias=True, expert_biases=True,
                         gpt_oss_layout=True,
                         mxfp4_experts=(hf.get("quantization_config") or {}).get("quant_method") == "mxfp4")
        else:
            return None
        return config if config.sparse_layers else None


def _deepseek_moe(cls: type[MoEConfig], hf: dict[str, Any], v3: bool, layers: range, act: str) -> MoEConfig:
    """DeepSeek's MoE as transformers 5.24 runs it: V2 scores by softmax and, whatever
    ``norm_topk_prob`` says, only scales the chosen weights (its ``DeepseekV2TopkRouter``;
    published V2 checkpoints say false); V3 always routes by ``noaux_tc`` (sigmoid, the
    correction bias), whatever ``topk_method`` and ``scoring_func`` say. Layer i is
    sparse from ``first_k_dense_replace`` on where ``i % moe_layer_freq == 0`` (the
    original modeling code's rule; transformers ignores ``moe_layer_freq``, which is 1
    in every published checkpoint)."""

    def value(key: str, v2_default: Any, v3_default: Any) -> Any:  # HF's default where absent or null
        found = hf.get(key)
        found = (v3_default if v3 else v2_default) if found is None else found
        if found is None:
            raise ValueError(f"moe config: config.json needs {key} (it has no default)")
        return found

    first_dense = int(value("first_k_dense_replace", 0, 3))
    frequency = int(value("moe_layer_freq", 1, 1))
    intermediate = int(value("moe_intermediate_size", 1407, 2048))
    method = "noaux_tc" if v3 else str(value("topk_method", "greedy", None))
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"moe config: DeepSeek-V2's topk_method must be 'greedy' or 'group_limited_greedy', "
                         f"got {method!r}")
    grouped = method != "greedy"
    return cls(num_experts=int(value("n_routed_experts", 64, 256)), top_k=int(value("num_experts_per_tok", None, 8)),
               intermediate_size=intermediate,
               sparse_layers=tuple(i for i in layers if i >= first_dense and i % frequency == 0),
               scoring="sigmoid" if v3 else "softmax", topk_method=method,
               norm_topk_prob=v3 and bool(value("norm_topk_prob", False, True)),
               routed_scaling_factor=float(value("routed_scaling_factor", 1.0, 2.5)),
               num_groups=int(value("n_group", None, 8)) if grouped else 1,
               topk_groups=int(value("topk_group", None, 4)) if grouped else 1,
               score_correction_bias=v3, router_float32=True,
               shared_expert_intermediate_size=intermediate * int(value("n_shared_experts", 2, 1)),
               hidden_act=act)


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


SSM_ARCHITECTURES = ("Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM")
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"  # IBM Granite 4.0: Bamba's layers with Granite's multipliers
# Names of a hybrid's layer kinds in config.json's ``layer_types`` (Granite 4.0's hub configs,
# and transformers 5's own names that it writes back).
_HYBRID_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                       "full_attention": "attention"}


@dataclass(frozen=True)
class SSMConfig:
    """Mamba2's state-space mixer (Mamba2, and the Mamba2 layers of the Bamba and Granite 4.0 hybrids).
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
        unknown = set(self.layer_kinds) - {"mamba", "attention", "mlp", "moe"}
        if unknown or "mamba" not in self.layer_kinds:
            raise ValueError(f"ssm config: layer kinds must be 'mamba', 'attention', 'mlp' or 'moe' (Nemotron-H's "
                             f"MLP-only and MoE blocks), at least one 'mamba', got {self.layer_kinds}")

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
        if arch == "NemotronHForCausalLM":
            heads, head_dim = int(hf.get("mamba_num_heads", 128)), int(hf.get("mamba_head_dim", 64))
            return cls(num_heads=heads, head_dim=head_dim, state_size=int(hf.get("ssm_state_size", 128)),
                       num_groups=int(hf.get("n_groups", 8)), conv_kernel=int(hf.get("conv_kernel", 4)),
                       intermediate_size=heads * head_dim, chunk_size=int(hf.get("chunk_size", 128)),
                       norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), time_step_limit=(limit[0], limit[1]),
                       use_conv_bias=bool(hf.get("use_conv_bias", True)),
                       use_bias=bool(hf.get("mamba_proj_bias", False)), layer_kinds=_nemotron_h_kinds(hf, layers))
        heads = int(hf.get("mamba_n_heads", 128))
        intermediate = int(hf.get("mamba_expand", 2) * hidden)
        head_dim = hf.get("mamba_d_head", "auto")
        return cls(num_heads=heads, head_dim=intermediate // heads if head_dim == "auto" else int(head_dim),
                   state_size=int(hf.get("mamba_d_state", 256)), num_groups=int(hf.get("mamba_n_groups", 1)),
                   conv_kernel=int(hf.get("mamba_d_conv", 4)), intermediate_size=intermediate,
                   chunk_size=int(hf.get("mamba_chunk_size", 256)), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                   time_step_limit=(limit[0], limit[1]), use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
                   use_bias=bool(hf.get("mamba_proj_bias", False)),
                   layer_kinds=_hybrid_layer_kinds(arch, hf, layers))

    def attention_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``hf`` with what ModelConfig requires of an attention model filled in where a
        pure state-space config (Mamba2) has none: one head of one number stands in for
        the attention shape, which sizes nothing (``ModelConfig.num_kv_layers`` is 0);
        the FFN size is the mixer's; the norms' eps is ``layer_norm_epsilon``."""
        if self.attention_layers or "num_attention_heads" in hf:
            return hf
        return {"num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": self.intermediate_size,
                "rms_norm_eps": self.norm_eps, **hf, "head_dim": 1}


SHORT_CONV_ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")


@dataclass(frozen=True)
class ShortConvConfig:
    """LiquidAI's LFM2: gated short convolutions (``conv`` layers: in_proj to B, C and x,
    B * x convolved causally per channel over its last ``conv_kernel`` inputs, times C,
    out_proj) between attention layers. Each conv layer keeps its last ``conv_kernel - 1``
    inputs per request, a state slot's whole state (cache/state_pool.py) as a Mamba2
    mixer's is. ``layer_kinds``: "conv" or "attention" per decoder layer."""

    conv_kernel: int
    bias: bool
    layer_kinds: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ValueError(f"short conv config: conv_L_cache must be an integer of at least 2, got "
                             f"{self.conv_kernel!r}")
        if set(self.layer_kinds) - {"conv", "attention"} or "conv" not in self.layer_kinds:
            raise ValueError(f"short conv config: layer kinds must be 'conv' or 'attention', at least one 'conv', "
                             f"got {self.layer_kinds}")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "attention")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ShortConvConfig | None:
        if (hf.get("architectures") or [""])[0] not in SHORT_CONV_ARCHITECTURES:
            return None
        layers = int(hf["num_hidden_layers"])
        names = hf.get("layer_types")
        if names is None:  # older configs: the attention layers' indices (transformers' default: all)
            indices = hf.get("full_attn_idxs")
            attention = set(range(layers) if indices is None else indices)
            names = ["full_attention" if i in attention else "conv" for i in range(layers)]
        kinds = {"conv": "conv", "full_attention": "attention", "attention": "attention"}
        if len(names) != layers or set(names) - set(kinds):
            raise ValueError(f"short conv config: layer_types must name {layers} layers, each 'conv' or "
                             f"'full_attention'; got {list(names)}")
        return cls(conv_kernel=int(hf.get("conv_L_cache", 3)), bias=bool(hf.get("conv_bias", False)),
                   layer_kinds=tuple(kinds[name] for name in names))


# Nemotron-H's block kinds: its pattern's letters and its layers_block_type names (transformers
# 5's and the hub's older ones); "E" / "moe": Nemotron 3's MoE blocks.
_NEMOTRON_H_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba",
                     "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
                     "mlp": "mlp", "moe": "moe"}


def nemotron_h_block_names(hf: dict[str, Any]) -> list[str]:
    """Nemotron-H's blocks as config.json names them: ``layers_block_type`` (transformers 5
    writes it back as ``layer_types`` too) or the hub's ``hybrid_override_pattern`` letters."""
    return list(hf.get("layers_block_type") or hf.get("layer_types") or str(hf.get("hybrid_override_pattern", "")))


def _nemotron_h_kinds(hf: dict[str, Any], layers: int) -> tuple[str, ...]:
    names = nemotron_h_block_names(hf)
    unknown = sorted({str(name) for name in names} - set(_NEMOTRON_H_KINDS))
    if unknown:
        raise ValueError(f"ssm config: Nemotron-H's block kinds {unknown} are not supported (supported: mamba, "
                         "attention, mlp, moe)")
    if not names or ("num_hidden_layers" in hf and len(names) != layers):
        raise ValueError(f"ssm config: Nemotron-H needs layers_block_type or hybrid_override_pattern naming "
                         f"{layers} blocks, got {names!r}")
    return tuple(_NEMOTRON_H_KINDS[name] for name in names)


def _hybrid_layer_kinds(arch: str, hf: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Which layers of a hybrid are mixers: Bamba's ``attn_layer_indices`` attend; Granite
    4.0 names every layer in ``layer_types`` (all mixers where absent, as transformers)."""
    if arch != GRANITE_HYBRID:
        attention = set(hf.get("attn_layer_indices") or ())
        return tuple("attention" if i in attention else "mamba" for i in range(layers))
    names = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
    unknown = sorted({str(name) for name in names} - set(_HYBRID_LAYER_KINDS))
    if unknown or len(names) != layers:
        raise ValueError(f"ssm config: layer_types must name {layers} layers, each one of "
                         f"{', '.join(_HYBRID_LAYER_KINDS)}; got {list(names)}")
    return tuple(_HYBRID_LAYER_KINDS[name] for name in names)


@dataclass(frozen=True)
class Multipliers:
    """Multipliers on Llama's layers: the embedding times ``embedding``, each block's
    output times ``residual`` before it joins the residual stream, attention scores times
    ``attention`` (instead of 1/sqrt(head_dim)), the logits divided by ``logits``. IBM
    Granite's four (``GraniteForCausalLM``, and Granite 4.0's hybrid), and Gemma 2 and 3's attention scale
    (``query_pre_attn_scalar`` ** -0.5; Gemma scales its embedding itself, models/gemma.py)."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits: float = 1.0
    logit_scale: float = 1.0  # the logits times it (Cohere's, after any division by ``logits``)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Multipliers | None:
        architecture = (hf.get("architectures") or [""])[0]
        if architecture in ("CohereForCausalLM", "Cohere2ForCausalLM"):  # transformers' default: 0.0625
            scale = hf.get("logit_scale", 0.0625)
            return None if scale is None or float(scale) == 1.0 else cls(logit_scale=float(scale))
        if architecture in GEMMA_ARCHITECTURES:
            scalar = hf.get("query_pre_attn_scalar")  # Gemma 2 and 3's; Gemma's own is head_dim's
            return None if scalar is None else cls(attention=float(scalar) ** -0.5)
        if architecture not in ("GraniteForCausalLM", "GraniteMoeForCausalLM", GRANITE_HYBRID):
            return None
        attention = hf.get("attention_multiplier")
        return cls(float(hf.get("embedding_multiplier", 1.0)), float(hf.get("residual_multiplier", 1.0)),
                   None if attention is None else float(attention), float(hf.get("logits_scaling", 1.0)))


GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # transformers runs Gemma's "gelu" as the tanh one too


@dataclass(frozen=True)
class GemmaLayers:
    """What Google's Gemma changes in Llama's layers (models/gemma.py): every RMSNorm
    scales by (1 + weight), in float32; the gated MLP's activation is GELU (tanh);
    Gemma 2 and 3 norm each block's output before it joins the residual stream
    (``sandwich_norms``: post-attention and post-feedforward norms, and a pre-feedforward
    one in place of Llama's post-attention norm). Gemma 2 caps the logits (``final_softcap``
    * tanh(logits / it)) and its attention scores alike (``attention_softcap``); Gemma 3's
    sliding-window layers turn the rotary at their own base (ModelConfig's
    ``local_rope_theta``) and it norms every query and key head (``qk_norm``)."""

    sandwich_norms: bool = False
    final_softcap: float | None = None
    attention_softcap: float | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GemmaLayers | None:
        architecture = (hf.get("architectures") or [""])[0]
        if architecture not in GEMMA_ARCHITECTURES:
            return None
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in GEMMA_ACTIVATIONS:
            raise ValueError(f"model config: {architecture}'s hidden_activation {activation!r} is not served "
                             f"(supported: {', '.join(GEMMA_ACTIVATIONS)})")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"model config: {architecture} with use_bidirectional_attention (an embedding "
                             "model's) is not served: kvloom's attention is causal")
        return cls(sandwich_norms=architecture != "GemmaForCausalLM",
                   final_softcap=_optional_float(hf.get("final_logit_softcapping")),
                   attention_softcap=_optional_float(hf.get("attn_logit_softcapping")))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# vLLM's pooling types for a whole input (its SequencePoolingType), and the one per token.
SEQ_POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding is pooled from the final hidden states (vLLM's ``PoolerConfig``):
    ``seq_pooling`` "LAST" (the last token's state: vLLM's default for decoder models),
    "MEAN" (the mean over the prompt's tokens) or "CLS" (the first token's), and whether
    the vector (and each of "token_embed"'s) is L2-normalized (vLLM's ``use_activation``).
    Read from config.json's ``pooler_config``, which the engine fills from
    ``--pooler-config`` over a sentence-transformers model's own (modules.json)."""

    seq_pooling: str = "LAST"
    normalize: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> PoolerConfig:
        """vLLM's spellings: ``pooling_type`` (one of SEQ_POOLING_TYPES, or "ALL", every
        token's, which is no whole-input choice), or ``seq_pooling_type`` /
        ``tok_pooling_type`` ("ALL"), and ``use_activation``; any other key is refused."""
        spec = hf.get("pooler_config") or {}
        if not isinstance(spec, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {spec!r}")
        unknown = set(spec) - {"pooling_type", "seq_pooling_type", "tok_pooling_type", "use_activation"}
        if unknown:
            raise ValueError(f"pooler_config: {', '.join(sorted(unknown))} not supported (the keys are pooling_type, "
                             "seq_pooling_type, tok_pooling_type, use_activation)")
        if spec.get("pooling_type") is not None and spec.get("seq_pooling_type") is not None:
            raise ValueError("pooler_config: give pooling_type or seq_pooling_type, not both")
        kind = spec.get("seq_pooling_type") or spec.get("pooling_type") or "LAST"
        token_kind = spec.get("tok_pooling_type") or ("ALL" if kind == "ALL" else None)
        if token_kind not in (None, "ALL"):
            raise ValueError(f"pooler_config: tok_pooling_type must be 'ALL' (every token's state), got {token_kind!r}")
        if kind == "ALL":
            kind = "LAST"
        if not isinstance(kind, str) or kind.upper() not in SEQ_POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(SEQ_POOLING_TYPES)} or ALL, "
                             f"got {kind!r}")
        normalize = spec.get("use_activation", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config: use_activation must be a bool, got {normalize!r}")
        return cls(kind.upper(), normalize)


CLASSIFIER_SUFFIX = "ForSequenceClassification"
TOKEN_CLASSIFIER_SUFFIX = "ForTokenClassification"


@dataclass(frozen=True)
class ClassifierConfig:
    """A sequence classifier (transformers' ``LlamaForSequenceClassification``,
    ``Qwen2ForSequenceClassification`` and the like): the causal model's decoder with a
    ``score`` head (hidden -> ``num_labels``, no bias) in place of the vocabulary head,
    read at the input's last token (vLLM's last-token pooling; transformers reads the
    last token that is not padding, the same token for an unpadded input). With one
    label the model is a cross-encoder: a pair's score is that logit.

    vLLM's ``classifier_from_token`` makes a causal LM such a classifier through
    ``--hf-overrides`` (the original Qwen3-Reranker's way): the head is the vocabulary
    head's rows of those tokens, so class i's logit is token i's. With two tokens and
    ``two_way`` (vLLM's ``from_2_way_softmax``, which ``is_original_qwen3_reranker``
    implies), the head is one row, the second token's minus the first's: a pair's
    sigmoid is then the softmax of the two tokens' logits, p("yes") of ["no", "yes"].

    A token classifier (``LlamaForTokenClassification`` and the like, ``per_token``) has
    the same decoder and a ``score`` head with a bias (unless config.json's
    ``token_classification_bias`` is false), read at every token (vLLM's
    ``token_classify``)."""

    num_labels: int
    labels: tuple[str, ...]  # config.json's id2label, by class index
    # problem_type "multi_label_classification": each class its own sigmoid.
    multi_label: bool = False
    source_tokens: tuple[str, ...] = ()  # classifier_from_token: the head from these tokens' rows
    two_way: bool = False
    # The source tokens' ids, which the tokenizer gives (``with_token_ids``) before the
    # weights are read; empty until then.
    source_token_ids: tuple[int, ...] = ()
    per_token: bool = False  # a token classifier: each token classified
    bias: bool = False  # the score head's bias (a token classifier's, by default)

    def __post_init__(self) -> None:
        if not isinstance(self.num_labels, int) or self.num_labels <= 0:
            raise ValueError(f"model config: num_labels must be a positive integer, got {self.num_labels!r}")
        if len(self.labels) != self.num_labels:
            raise ValueError(f"model config: id2label names {len(self.labels)} classes, num_labels is "
                             f"{self.num_labels}")
        if self.two_way and len(self.source_tokens) != 2:
            raise ValueError(f"model config: a two-way classifier (from_2_way_softmax) takes two classifier_from_token "
                             f"entries, the negative one first; got {list(self.source_tokens)}")

    @property
    def activation(self) -> str:
        """What turns the logits into probabilities, as transformers' problem types and
        vLLM's classify do: ``sigmoid`` for one label or several independent ones,
        ``softmax`` over the classes otherwise."""
        return "sigmoid" if self.num_labels == 1 or self.multi_label else "softmax"

    def with_token_ids(self, token_to_id: Callable[[str], int | None]) -> ClassifierConfig:
        """This config with its source tokens' ids (ValueError naming a token the
        vocabulary does not hold as one token)."""
        ids = []
        for token in self.source_tokens:
            token_id = token_to_id(token)
            if token_id is None:
                raise ValueError(f"classifier_from_token: {token!r} is not one token of this model's vocabulary")
            ids.append(token_id)
        return replace(self, source_token_ids=tuple(ids))

    @property
    def kind(self) -> str:
        """How the model names itself in messages."""
        return "token classifier" if self.per_token else "sequence classifier"

    @staticmethod
    def causal_architecture(architecture: str) -> str:
        """``XForSequenceClassification`` / ``XForTokenClassification`` -> ``XForCausalLM``:
        the decoder it is built on."""
        return architecture.removesuffix(CLASSIFIER_SUFFIX).removesuffix(TOKEN_CLASSIFIER_SUFFIX) + "ForCausalLM"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ClassifierConfig | None:
        """None unless config.json's architecture is a ``*ForSequenceClassification`` or a
        ``*ForTokenClassification``. transformers writes ``id2label`` for every classifier
        (``LABEL_i`` by default) and derives ``num_labels`` from it; either may be missing
        in a hand-written one."""
        architecture = (hf.get("architectures") or [""])[0]
        per_token = architecture.endswith(TOKEN_CLASSIFIER_SUFFIX)
        if not architecture.endswith(CLASSIFIER_SUFFIX) and not per_token:
            return None
        tokens = None if per_token else hf.get("classifier_from_token")
        if tokens is not None:
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
                raise ValueError(f"model config: classifier_from_token must be a list of token strings, got {tokens!r}")
            two_way = bool(hf.get("is_original_qwen3_reranker")) or hf.get("method") == "from_2_way_softmax"
            labels = (tokens[-1],) if two_way else tuple(tokens)
            return cls(num_labels=len(labels), labels=labels, source_tokens=tuple(tokens), two_way=two_way)
        id2label = hf.get("id2label") or {}
        num_labels = hf.get("num_labels", len(id2label) or 2)
        try:
            by_index = {int(index): str(label) for index, label in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(f"model config: id2label must map class indices to names, got {id2label!r}") from None
        labels = tuple(by_index.get(index, f"LABEL_{index}") for index in range(num_labels))
        return cls(num_labels=num_labels, labels=labels,
                   multi_label=hf.get("problem_type") == "multi_label_classification", per_token=per_token,
                   bias=per_token and bool(hf.get("token_classification_bias", True)))
