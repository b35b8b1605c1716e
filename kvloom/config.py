"""Frozen configuration dataclasses. Validation lives in ``__post_init__`` and every
message names the field, so a bad CLI flag and a bad ``LLM(...)`` keyword read alike."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloom.generation_config import json_object, parse_override
from kvloom.model_families import (
    GEMMA_ARCHITECTURES,
    GRANITE_HYBRID,
    ClassifierConfig,
    GemmaLayers,
    MLAConfig,
    MoEConfig,
    Multipliers,
    PoolerConfig,
    ShortConvConfig,
    SSMConfig,
    nemotron_h_block_names,
)

DEFAULT_MODEL = "smollm2-135m-instruct"

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
MATMULS = ("invariant", "onednn", "torch")  # EngineConfig.matmul (models/packed_linear.py)
DECODER_STACKS = ("native", "modules")  # EngineConfig.decoder_stack (models/decoder_stack.py)
OVERLAP_MODES = ("auto", "on", "off")  # EngineConfig.overlap_scheduling (engine/overlap.py)
SCHEDULING_MODES = ("continuous", "static")
# The registries' names (engine/policy.py POLICIES, attention/registry.py BACKENDS), here so
# that a bad flag is refused before the model loads; tests hold them to the registries.
POLICY_NAMES = ("fcfs", "priority", "fcfs-cheapest-victim", "watermark", "lpm")
ATTENTION_BACKENDS = ("auto", "cpu_paged", "triton", "flashinfer", "flash_attn", "torch_ref", "mla_cpu", "mla_batched",
                      "mla_ref")
DEFAULT_KV_CACHE_MEMORY = 1.0  # GiB, when neither kv_cache_memory nor gpu_memory_utilization is set
GENERATION_CONFIG_MODES = ("auto", "vllm", "none")  # or a directory (kvloom/generation_config.py)
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def parse_device(value: str) -> str:
    """A device name: auto, cpu, cuda, cuda:N or mps (checked before the model loads)."""
    if not isinstance(value, str) or not _DEVICE_PATTERN.fullmatch(value):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {value!r}")
    return value


COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")
GLM_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")
# Families whose rotary turns half of each head unless config.json says otherwise (transformers' defaults).
HALF_ROTARY_BY_DEFAULT = ("NemotronForCausalLM", *GLM_ARCHITECTURES)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Exaone4ForCausalLM",
                         "Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
# Families whose projections (and MLP) have biases unless config.json says otherwise.
ALWAYS_BIASED = ("PhiForCausalLM", "GPTNeoXForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM",
                 "GPTBigCodeForCausalLM")
ONE_KV_HEAD_PER_HEAD = ("GPTNeoXForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "GPTJForCausalLM")
# Families whose positions are learned embeddings added to the tokens' (no rotary in any layer).
LEARNED_POSITIONS = ("GPT2LMHeadModel", "OPTForCausalLM", "GPTBigCodeForCausalLM")
# Families whose config.json names the shape as GPT-2's does (n_embd, n_head, n_layer, ...).
GPT2_NAMES = ("GPT2LMHeadModel", "GPTBigCodeForCausalLM")


def _local_rope(local: dict[str, Any], local_base: Any, theta: float,
                scaling: tuple[tuple[str, Any], ...] | None) -> dict[str, Any]:
    """ModelConfig's local_rope_* from config.json's ``rope_parameters["sliding_attention"]``
    (or Gemma 3's ``rope_local_base_freq``): set only where the windowed layers' rotary is
    not the full layers' (then they share one table)."""
    if not local and local_base is None:
        return {}
    local_theta = float(local.get("rope_theta", local_base if local_base is not None else theta))
    kind = local.get("rope_type", "default")
    local_scaling = (None if kind == "default" else
                     tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in local.items()
                                  if k != "rope_theta")))
    if local_theta == theta and local_scaling == scaling:
        return {}
    return {"local_rope_theta": local_theta, "local_rope_scaling": local_scaling}


def _no_rope_layers(arch: str, hf: dict[str, Any]) -> tuple[int, ...]:
    """The layers without rotary: all of GPT-2's and OPT's (their positions are in their embeddings) and Granite
    4.0's without ``position_embedding_type`` "rope", EXAONE
    4's global ones where it has windowed ones, SmolLM3's by its no_rope_layers flags (1: the
    layer turns q and k), else every ``no_rope_layer_interval``-th layer (transformers'
    default, 4); no other family's."""
    layers = int(hf["num_hidden_layers"])
    if arch in LEARNED_POSITIONS:
        return tuple(range(layers))
    if arch == "Exaone4ForCausalLM":  # with a window, its global layers have no position encoding
        kinds = hf.get("layer_types") or ()
        if not hf.get("sliding_window"):
            return ()
        return tuple(i for i, kind in enumerate(kinds) if kind != "sliding_attention")
    if arch == "Cohere2ForCausalLM":  # only its windowed layers turn the rotary (none without a window)
        kinds = hf.get("layer_types") or ()
        return tuple(i for i in range(layers) if not hf.get("sliding_window") or kinds[i] != "sliding_attention")
    if arch == "NemotronHForCausalLM":  # its attention has no position encoding
        return tuple(range(layers))
    if arch == GRANITE_HYBRID:  # Granite 4.0 turns no rotary unless it says "rope" (transformers' default: none)
        return () if hf.get("position_embedding_type") == "rope" else tuple(range(layers))
    if arch != "SmolLM3ForCausalLM":
        return ()
    interval = int(hf.get("no_rope_layer_interval", 4))
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"model config: no_rope_layers has {len(flags)} flags for {layers} layers")
    return tuple(i for i, turns in enumerate(flags) if not turns)


def _lfm2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config.json in the names the rest reads (transformers' Lfm2Config): the hub's
    ``block_ff_dim`` and ``tie_embedding``, its MLP's width as transformers computes it
    (two thirds of the stated one, times ``block_ffn_dim_multiplier``, rounded up to a
    multiple of ``block_multiple_of``, where ``block_auto_adjust_ff_dim``), the rotary's
    base (1e6 where unsaid) and its tied head."""
    moe = hf["architectures"][0] == "Lfm2MoeForCausalLM"  # its dense MLPs take intermediate_size as it is
    width = int(hf.get("block_ff_dim", hf.get("intermediate_size", 7168 if moe else 12288)))
    if hf.get("block_auto_adjust_ff_dim", True) and not moe:
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = int(hf.get("block_multiple_of", 256))
            width = int(float(hf.get("block_ffn_dim_multiplier", 1.0)) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    rope = hf.get("rope_parameters") or {}
    return {**hf, "intermediate_size": width, "tie_word_embeddings": bool(hf.get("tie_embedding",
                                                                                  hf.get("tie_word_embeddings", True))),
            "rope_theta": float(hf.get("rope_theta", rope.get("rope_theta", 1000000.0))),
            "rms_norm_eps": float(hf.get("norm_eps", 1e-5)), "attention_bias": False}


def _opt_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """OPT's config.json in the names the rest reads (transformers' OPTConfig): ffn_dim,
    activation_function, enable_bias; its LayerNorms take torch's default eps. Refused by name:
    the post-LayerNorm layers and the embedding projections of OPT-350m, and LayerNorms
    without weights."""
    if not hf.get("do_layer_norm_before", True):
        raise ValueError("model config: OPT with do_layer_norm_before false (LayerNorms after each block, "
                         "OPT-350m's) is not supported")
    hidden = hf["hidden_size"]
    if hf.get("word_embed_proj_dim", hidden) != hidden:
        raise ValueError(f"model config: OPT's word_embed_proj_dim {hf['word_embed_proj_dim']} differs from its "
                         f"hidden_size {hidden} (embeddings projected in and out, OPT-350m's): not supported")
    if not hf.get("layer_norm_elementwise_affine", True):
        raise ValueError("model config: OPT with layer_norm_elementwise_affine false is not supported")
    return {"tie_word_embeddings": True, **hf, "intermediate_size": hf["ffn_dim"],
            "hidden_act": hf.get("activation_function", "relu"), "layer_norm_eps": 1e-5,
            "use_bias": hf.get("enable_bias", True)}


def _falcon_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config.json in the names the rest reads (transformers' FalconConfig, and the
    n_head / n_layer / n_head_kv of older files): its KV heads (one with multi_query, unless the
    new architecture), side by side (parallel_attn, or the new architecture) with one norm or
    two, the MLP's width and activation, one bias flag. ALiBi (Falcon-RW) is refused by name."""
    if hf.get("alibi"):
        raise ValueError("model config: Falcon with alibi (ALiBi position biases, Falcon-RW's) is not supported")
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    new_architecture = bool(hf.get("new_decoder_architecture", False))
    kv_heads = hf.get("num_kv_heads", hf.get("n_head_kv")) or heads
    if not new_architecture and hf.get("multi_query", True):
        kv_heads = 1
    hidden = hf.get("hidden_size", hf.get("n_embed"))
    return {"tie_word_embeddings": True, **hf, "hidden_size": hidden, "num_attention_heads": heads,
            "num_hidden_layers": hf.get("num_hidden_layers", hf.get("n_layer")), "num_key_value_heads": kv_heads,
            "intermediate_size": hf.get("ffn_hidden_size") or 4 * hidden, "hidden_act": hf.get("activation", "gelu"),
            "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "use_bias": bool(hf.get("bias", False)),
            "use_parallel_residual": new_architecture or bool(hf.get("parallel_attn", True)),
            "num_ln_in_parallel_attn": hf.get("num_ln_in_parallel_attn") or (2 if new_architecture else 1)}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, normalised from any HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Kept as a sorted tuple of items so the config stays hashable and frozen.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k and v
    attention_output_bias: bool = False  # the output projection (Llama's attention_bias)
    mlp_bias: bool = False
    # config.json's hidden_act (hidden_activation): read by the families whose MLP is not
    # SiLU-gated (Phi's fc1 / fc2); Llama's gated MLP and Gemma's GeGLU fix their own.
    hidden_act: str = "silu"
    # ERNIE 4.5's and Helium's rotary turns adjacent pairs of each head (GLM's rotate_half); q and k
    # rows are regrouped at load (models/weights.halves_from_pairs) for Llama's, the same scores.
    interleaved_rotary: bool = False
    # OLMo 1's clip_qkv: every query, key and value number clamped to [-clip, clip] after the projection.
    clip_qkv: float | None = None
    # Layers that turn no query or key by the rotary (SmolLM3's NoPE layers: every fourth; all of GPT-2's).
    no_rope_layers: tuple[int, ...] = ()
    # GPT-NeoX's use_parallel_residual: attention and MLP read the same stream (each through
    # its own norm) and are added to it together, rather than one after the other.
    parallel_residual: bool = False
    # Falcon's num_ln_in_parallel_attn: the norms of a side-by-side layer, 2 (the MLP its own,
    # GPT-NeoX's and the new architecture's) or 1 (the MLP on the attention's normed input).
    parallel_norms: int = 2
    # Qwen3's: each query and key head RMS-normed (weights of head_dim) before the rotary.
    qk_norm: bool = False
    # GPT-OSS's attention sinks: a learned logit per query head in every layer's softmax
    # denominator (attention/base.py), read from the checkpoint's ``self_attn.sinks``.
    attention_sinks: bool = False
    # The rotary's dimensions of each head (Phi-4's partial_rotary_factor: its first ones);
    # None: the whole head. (Bamba's half-head rotary is set in models/bamba.py.)
    rotary_dim: int | None = None
    # A sliding window (Mistral, Phi-3, Qwen2's use_sliding_window): a query attends to its
    # last `sliding_window` keys, itself included; layers in full_attention_layers (Qwen2's
    # first max_window_layers, config.json's layer_types) attend to the whole context.
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    # The sliding-window layers' own rotary where it is not the full layers' (Gemma 3's
    # rope_local_base_freq, config.json's rope_parameters per layer kind: OLMo 3).
    local_rope_theta: float | None = None
    local_rope_scaling: tuple[tuple[str, Any], ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    moe: MoEConfig | None = None  # a mixture-of-experts FFN (model_families.py)
    mla: MLAConfig | None = None  # DeepSeek's latent attention: the pool holds latents
    ssm: SSMConfig | None = None  # Mamba2 mixers: a state per request (cache/state_pool.py)
    short_conv: ShortConvConfig | None = None  # LFM2's gated short convolutions: a state per request too
    # A sequence classifier's head in place of the vocabulary's (``architecture`` is then
    # the causal model it is built on): it classifies and scores, it does not generate.
    classifier: ClassifierConfig | None = None
    # Matryoshka embeddings (config.json's is_matryoshka / matryoshka_dimensions, as vLLM
    # reads them): an embedding's first k dimensions are an embedding too, for the listed
    # k (None: any k up to hidden_size).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    scales: Multipliers | None = None  # Granite's and Gemma's multipliers (model_families.py)
    gemma: GemmaLayers | None = None  # what Gemma changes in Llama's layers (model_families.py)
    # How embeddings are pooled (LAST / MEAN / CLS, normalized or not): vLLM's pooler config.
    pooler: PoolerConfig = field(default_factory=PoolerConfig)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` turns its rotary by the local tables (a windowed layer of
        a model whose windowed layers have their own)."""
        return (self.local_rope_theta is not None and self.sliding_window is not None
                and layer not in self.full_attention_layers)

    def attention_window(self, layer: int, max_positions: int) -> int:
        """The keys layer ``layer`` attends back to when contexts reach ``max_positions``
        tokens: its sliding window, or 0 for the whole context (no window, a full-attention
        layer, or a window no context served can pass, which then masks nothing)."""
        if self.sliding_window is None or layer in self.full_attention_layers or max_positions <= self.sliding_window:
            return 0
        return self.sliding_window

    def kv_window(self, max_positions: int) -> int:
        """The keys back from a query that some layer still reads: the largest window when
        every layer has one, else 0 (a layer reads the whole context, so no KV block is
        ever behind every layer's window; cache/kv_manager.py lets go of those that are)."""
        if self.keeps_state:  # a hybrid's attention layers are some of its layers
            return 0
        windows = [self.attention_window(layer, max_positions) for layer in range(self.num_layers)]
        return max(windows) if windows and min(windows) > 0 else 0

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def long_rope_from(self, max_positions: int) -> int | None:
        """LongRoPE's original context where contexts run past it (``max_positions``): the
        tokens from it on, and every token of a prompt longer than it, turn by the long
        factors, the rest by the short ones (transformers' generate: a forward's factors by
        its length, the prompt's one forward, then a token at a time); None where one set
        serves every token (no LongRoPE, or no context past the original)."""
        scaling = self.rope_scaling_dict
        if not scaling or scaling.get("rope_type", scaling.get("type")) != "longrope":
            return None
        original = int(scaling["original_max_position_embeddings"])
        return original if max_positions > original else None

    @property
    def keeps_state(self) -> bool:
        """Whether some layers keep a fixed state per request in a state slot (Mamba2 mixers,
        LFM2's short convolutions): the engine then runs a state pool (engine/state_space.py)."""
        return self.ssm is not None or self.short_conv is not None

    @property
    def num_kv_layers(self) -> int:
        """Layers with a part in the paged KV pool: every layer, except that a model with
        state layers (``ssm``, ``short_conv``) has only its attention layers there (none for
        Mamba2)."""
        stateful = self.ssm or self.short_conv
        return self.num_layers if stateful is None else len(stateful.attention_layers)

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """What the paged pool holds per token and layer, as (planes, heads, numbers per
        head): K and V of each KV head, or MLA's one latent (K's shared rotary part
        after it)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral shapes)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("model config: config.json has no 'architectures' entry")
        classifier = ClassifierConfig.from_hf(hf)
        if classifier is not None:  # the causal model's decoder: read as that model's config
            hf = {**hf, "architectures": [ClassifierConfig.causal_architecture(archs[0])]}
            archs = hf["architectures"]
        if archs[0] in GPT2_NAMES:  # GPT-2's own names for the shape (transformers' attribute_map)
            if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
                raise ValueError(f"model config: {archs[0]} attention scaled otherwise than by head_dim ** -0.5 "
                                 "(scale_attn_weights off, or scale_attn_by_inverse_layer_idx on) is not supported")
            # GPTBigCode's keys and values: one head's for every query head unless multi_query is off.
            kv_heads = 1 if archs[0] == "GPTBigCodeForCausalLM" and hf.get("multi_query", True) else hf["n_head"]
            hf = {"tie_word_embeddings": True, **hf, "intermediate_size": hf.get("n_inner") or 4 * hf["n_embd"],
                  "hidden_act": hf.get("activation_function", "gelu_pytorch_tanh"),
                  "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "hidden_size": hf["n_embd"],
                  "num_attention_heads": hf["n_head"], "num_key_value_heads": kv_heads,
                  "num_hidden_layers": hf["n_layer"], "max_position_embeddings": hf["n_positions"]}
        if archs[0] == "OPTForCausalLM":
            hf = _opt_fields(hf)
        if archs[0] == "FalconForCausalLM":
            hf = _falcon_fields(hf)
        if archs[0] == "GPTJForCausalLM":  # GPT-2's names for the shape; biases on the MLP alone
            hidden, heads = hf["n_embd"], hf["n_head"]
            rotary = hf.get("rotary_dim") or hidden // heads
            hf = {**hf, "hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": hf["n_layer"],
                  "max_position_embeddings": hf["n_positions"], "intermediate_size": hf.get("n_inner") or 4 * hidden,
                  "hidden_act": hf.get("activation_function", "gelu_new"),
                  "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5), "attention_bias": False, "mlp_bias": True,
                  "partial_rotary_factor": rotary / (hidden // heads)}
        if archs[0] == "OlmoeForCausalLM" and hf.get("clip_qkv") is not None:
            raise ValueError("model config: OLMoE's clip_qkv (q and k clamped after their norms) is not supported")
        if archs[0] == "Cohere2ForCausalLM" and hf.get("layer_types") is None:  # older configs: a pattern
            pattern = int(hf.get("sliding_window_pattern", 4))
            hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                        for i in range(hf["num_hidden_layers"])]}
        if archs[0] in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):
            hf = _lfm2_fields(hf)
        if archs[0] == "NemotronHForCausalLM":  # its names for the MLP's activation and the norms' eps
            # transformers 5.25 never ties its head (its _tied_weights_keys is empty), whatever
            # tie_word_embeddings says: the checkpoint's lm_head is the head.
            hf = {**hf, "hidden_act": hf.get("mlp_hidden_act", "relu2"),
                  "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
                  "num_hidden_layers": len(nemotron_h_block_names(hf)), "tie_word_embeddings": False}
        if archs[0] == GRANITE_HYBRID and int(hf.get("num_local_experts", 8)) == 0:
            # No experts (most Granite 4.0 models): the shared MLP is the layers' dense FFN.
            hf = {**hf, "intermediate_size": hf.get("shared_intermediate_size", 1024)}
        ssm = SSMConfig.from_hf(hf)
        if ssm is not None:  # a pure state-space model has no attention fields
            hf = ssm.attention_fields(hf)
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling") or None
        # transformers >= 5 stores rope settings under "rope_parameters".
        rope_params = hf.get("rope_parameters") or {}
        local_rope = rope_params.get("sliding_attention") or {}  # per layer kind (Gemma 3, OLMo 3)
        rope_params = rope_params.get("full_attention", rope_params)
        theta_default = 150000.0 if archs[0] == "GptOssForCausalLM" else 10000.0  # each config class's
        rope_theta = hf.get("rope_theta", hf.get("rotary_emb_base",  # NeoX's
                                                 rope_params.get("rope_theta", theta_default)))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        # (GPT-NeoX names it rotary_pct; older StableLM configs rope_pct.)
        partial = rope_params.get("partial_rotary_factor", 0.5 if archs[0] in HALF_ROTARY_BY_DEFAULT else 1.0)
        partial = hf.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("rope_pct", partial)))
        head_dim = hf.get("head_dim") or hidden // num_heads
        rotary_dim = None if partial == 1.0 or archs[0] == "BambaForCausalLM" else int(head_dim * partial)
        if rotary_dim is not None and (rotary_dim % 2 or not 0 < rotary_dim <= head_dim):
            raise ValueError(f"model config: partial_rotary_factor {partial} gives {rotary_dim} rotary dimensions of "
                             f"a {head_dim}-dimension head: they must be even and at most the head's")
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "longrope":
            # Phi-3's: the factor and the context it scales live beside rope_scaling in config.json.
            original = rope_scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
            if original is None:
                raise ValueError("model config: longrope rope_scaling needs original_max_position_embeddings")
            rope_scaling = {"max_position_embeddings": hf.get("max_position_embeddings", 2048), **rope_scaling,
                            "original_max_position_embeddings": original}
        if rope_scaling is not None:
            rope_scaling = tuple(sorted(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in rope_scaling.items()
            ))
        arch = archs[0]
        # Qwen2 always has q/k/v bias; Llama and Mistral use the attention_bias flag.
        # (Qwen2-MoE names the same flag qkv_bias, StableLM use_qkv_bias.)
        # (StarCoder2 names one flag for every projection's bias use_bias.)
        # (Phi has a bias on every projection and no flag; GPT-NeoX's flag defaults to biases.)
        default_bias = hf.get("use_bias", arch.startswith("Qwen2") or arch in (*ALWAYS_BIASED, "GptOssForCausalLM"))
        attention_bias = bool(hf.get("attention_bias", hf.get("qkv_bias", hf.get("use_qkv_bias", default_bias))))
        # Qwen's configs keep a window off unless use_sliding_window says so (transformers' default).
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", not arch.startswith("Qwen")) else None
        layer_types = hf.get("layer_types")
        if layer_types is None and hf.get("max_window_layers") is not None:  # Qwen2's: the first ones full
            layer_types = ["full_attention" if i < hf["max_window_layers"] else "sliding_attention"
                           for i in range(hf["num_hidden_layers"])]
        full_layers = tuple(i for i, kind in enumerate(layer_types or ()) if kind != "sliding_attention")
        # transformers' Llama gives o_proj the same bias flag; Qwen2 and Mistral never; Seed-OSS its own.
        output_bias = (bool(hf.get("attention_out_bias")) if arch == "SeedOssForCausalLM" else
                       attention_bias and arch in ("LlamaForCausalLM", "BambaForCausalLM", "Starcoder2ForCausalLM",
                                                   "GptOssForCausalLM",
                                                   "Ernie4_5ForCausalLM", "FalconForCausalLM", *ALWAYS_BIASED,
                                                   *COHERE_ARCHITECTURES))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            # GPT-NeoX and GPT-2 have a KV head per query head (transformers reads no num_key_value_heads there).
            num_kv_heads=(hf.get("num_key_value_heads") if arch not in ONE_KV_HEAD_PER_HEAD else None) or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            # The LayerNorms' eps: StarCoder2's norm_epsilon, Phi's layer_norm_eps, Nemotron's norm_eps.
            rms_norm_eps=hf.get("norm_epsilon", hf.get("layer_norm_eps", hf.get("norm_eps", hf.get("rms_norm_eps",
                                                                                                 1e-6)))),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            # A classifier's score head is its own (transformers ties no head of one).
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)) and classifier is None,
            attention_bias=attention_bias,
            attention_output_bias=output_bias,
            mlp_bias=bool(hf.get("mlp_bias", hf.get("use_bias", arch in ALWAYS_BIASED))),
            # Phi's flag, Cohere's (Command R+)
            qk_norm=arch in QK_NORM_ARCHITECTURES or bool(hf.get("qk_layernorm", hf.get("use_qk_norm"))),
            attention_sinks=arch == "GptOssForCausalLM",
            hidden_act=str(hf.get("hidden_act", hf.get("hidden_activation", "silu"))),
            parallel_residual=bool(hf.get("use_parallel_residual", arch == "GPTNeoXForCausalLM")),  # HF's default
            parallel_norms=int(hf.get("num_ln_in_parallel_attn") or 2),
            no_rope_layers=_no_rope_layers(arch, hf),
            interleaved_rotary=arch in ("Ernie4_5ForCausalLM", "HeliumForCausalLM", "GPTJForCausalLM",
                                        *COHERE_ARCHITECTURES, *GLM_ARCHITECTURES),
            clip_qkv=None if hf.get("clip_qkv") is None else float(hf["clip_qkv"]),
            rotary_dim=rotary_dim,
            sliding_window=sliding,
            full_attention_layers=full_layers if sliding else (),
            **_local_rope(local_rope, hf.get("rope_local_base_freq"), float(rope_theta), rope_scaling),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            moe=MoEConfig.from_hf(hf),
            mla=MLAConfig.from_hf(hf),
            ssm=ssm,
            short_conv=ShortConvConfig.from_hf(hf),
            classifier=classifier,
            is_matryoshka=bool(hf.get("is_matryoshka")) or hf.get("matryoshka_dimensions") is not None,
            matryoshka_dimensions=(None if hf.get("matryoshka_dimensions") is None
                                   else tuple(int(d) for d in hf["matryoshka_dimensions"])),
            pooler=PoolerConfig.from_hf(hf),
            scales=Multipliers.from_hf(hf),
            gemma=GemmaLayers.from_hf(hf),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. ``num_blocks`` wins over ``kv_cache_memory`` (GiB) and
    ``gpu_memory_utilization`` (a share of the device's memory); those two exclude each
    other, and with neither the pool takes ``DEFAULT_KV_CACHE_MEMORY`` GiB."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block, the page of the paged cache"})
    num_blocks: int | None = field(default=None, metadata={
        "aliases": ("--num-gpu-blocks-override",),  # vLLM's name (on every device here)
        "help": "KV blocks in the pool (wins over --kv-cache-memory)"})
    kv_cache_memory: float | None = field(default=None, metadata={
        "help": f"GiB for the KV pool (default: {DEFAULT_KV_CACHE_MEMORY:g} unless "
                "--gpu-memory-utilization is given; not both)"})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "share (0, 1] of memory for the KV pool, instead of --kv-cache-memory: on CUDA "
                "of the device's total memory less what the weights already hold; on CPU of the "
                "RAM free when the engine starts"})
    num_state_slots: int | None = field(default=None, metadata={
        "help": "state slots of a state-space model (Mamba2, Bamba): one per running request, each "
                "holding every mixer layer's convolution and SSM state (default: --max-num-seqs)"})
    num_state_checkpoints: int | None = field(default=None, metadata={
        "help": "state-space models with prefix caching: slots beside the state slots that keep the "
                "mixers' state after cached prefixes, which a prefix hit needs (default: "
                "--num-state-slots; 0: no prefix reuse for such a model)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "negatives": ("--no-enable-prefix-caching", "--no-prefix-cache"),
        "help": "the radix prefix cache: KV reuse across requests (default: on)"})

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.num_state_slots is not None and (not isinstance(self.num_state_slots, int)
                                                 or self.num_state_slots <= 0):
            raise ValueError(f"num_state_slots must be a positive integer, got {self.num_state_slots!r}")
        if self.num_state_checkpoints is not None and (not isinstance(self.num_state_checkpoints, int)
                                                       or self.num_state_checkpoints < 0):
            raise ValueError(f"num_state_checkpoints must be a non-negative integer, got "
                             f"{self.num_state_checkpoints!r}")
        if self.kv_cache_memory is not None and (
                isinstance(self.kv_cache_memory, bool) or not isinstance(self.kv_cache_memory, (int, float))
                or not 0 < self.kv_cache_memory < math.inf):  # NaN fails too
            raise ValueError(f"kv_cache_memory must be a finite number > 0 (GiB), got {self.kv_cache_memory!r}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (not isinstance(utilization, (int, float))
                                        or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if utilization is not None and self.kv_cache_memory is not None:
            raise ValueError("kv_cache_memory and gpu_memory_utilization both size the KV pool: "
                             f"give one (got kv_cache_memory={self.kv_cache_memory}, "
                             f"gpu_memory_utilization={utilization})")


DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")  # ParallelConfig.distributed_backend


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes serve one model: ``tensor_parallel_size`` ranks each hold a
    shard of every weight and of the KV pool (kvloom/distributed/). Rank 0 runs the
    scheduler and samples; the others run the forward it broadcasts."""

    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("-tp",),
        "help": "ranks that shard the model (Megatron-style, on torch.distributed): spawned on "
                "this host, or started by torchrun across hosts"})
    distributed_backend: str = field(default="auto", metadata={
        "choices": DISTRIBUTED_BACKENDS,
        "help": "torch.distributed backend for tensor parallel: auto (nccl on CUDA, gloo on CPU)"})
    shared_memory: bool = field(default=True, metadata={
        "negatives": ("--no-shared-memory",),
        "help": "ranks of one host (CPU) run the steps' collectives through shared memory, not gloo "
                "(default: on)"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "mixture-of-experts layers under tensor parallel: each rank holds whole experts, "
                "an equal share of them, instead of a share of every expert's features (vLLM's flag)"})
    distributed_timeout: float = field(default=300.0, metadata={
        "help": "seconds a step's collective waits for the other ranks before every rank gives up "
                "(a rank that dies is noticed at once; an idle engine never times out)"})

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_backend must be one of {DISTRIBUTED_BACKENDS}, "
                             f"got {self.distributed_backend!r}")
        timeout = self.distributed_timeout
        # At most a year: torch's timedelta overflows past ~1e14 s, and nan/inf are not waits.
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 365 * 86400):
            raise ValueError(f"distributed_timeout must be > 0 and at most a year (seconds), got {timeout!r}")


KV_ROLES = ("both", "prefill", "decode", "disaggregated")
KV_TRANSPORTS = ("shm", "torch")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (kvloom/kv_transfer/): what this instance does with
    prompts' KV. A prefill instance computes prompts and stages their KV blocks; a
    decode instance pulls them and decodes; the router pairs them."""

    role: str = field(default="both", metadata={
        "choices": KV_ROLES,
        "help": "'both': prefill and decode here (default); 'prefill': compute prompts and stage their "
                "KV for decode instances; 'decode': admit requests whose KV a prefill instance staged; "
                "'disaggregated' (kvloom serve only): one prefill + one decode instance and a router "
                "on this host"})
    kv_transport: str = field(default="shm", metadata={
        "choices": KV_TRANSPORTS,
        "help": "how a decode instance pulls staged KV: 'shm' (shared memory, same host) or 'torch' "
                "(torch.distributed point-to-point, gloo on CPU, across hosts); a prefill instance "
                "serves both"})
    kv_host: str = field(default="127.0.0.1", metadata={
        "help": "the address a prefill instance's torch.distributed KV server binds and advertises"})
    kv_port: int = field(default=0, metadata={
        "help": "that server's port (0: a free one)"})
    kv_buffer_gib: float = field(default=2.0, metadata={
        "help": "GiB of staged KV a prefill instance keeps for decode instances to pull; when it is "
                "full, new prompts wait (back-pressure from slow decode instances)"})
    kv_transfer_timeout: float = field(default=120.0, metadata={
        "help": "seconds staged KV waits to be pulled before the prefill instance drops it; also "
                "the torch transport's operation timeout"})
    kv_shm_dir: str = field(default="/dev/shm", metadata={
        "help": "where a prefill instance stages KV files (a memory-backed file system) and the only "
                "place a decode instance reads them from"})

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"role must be one of {KV_ROLES}, got {self.role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a port number (0: a free one), got {self.kv_port!r}")
        for name in ("kv_buffer_gib", "kv_transfer_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters beside the base model (kvloom/lora; vLLM's flags): requests name an
    adapter (``LoRARequest``; the server's ``model`` field), loaded on first use into
    one of ``max_loras`` slots of rank at most ``max_lora_rank``."""

    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT directories) beside the base model"})
    max_loras: int = field(default=4, metadata={"help": "adapters loaded at once (with requests in flight or idle)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest adapter rank that can be loaded"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept read in memory, so that one loaded into a slot again is not read from disk "
                "again (least recently used dropped first; at least max_loras; default: max_loras)"})

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the scheduling policy. The scheduler thinks in tokens."""

    max_num_seqs: int = field(default=64, metadata={"help": "most requests in the running batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "token budget of one engine step (prefill chunks + decodes)"})
    scheduling: str = field(default="continuous", metadata={
        "choices": SCHEDULING_MODES,
        "help": "'continuous': requests join and leave the batch at every step; 'static': a "
                "batch runs until all of it has finished (for comparison)"})
    policy: str = field(default="fcfs", metadata={
        "choices": POLICY_NAMES, "aliases": ("--scheduling-policy",),  # vLLM's name (fcfs, priority)
        "help": "scheduling policy (engine/policy.py)"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "negatives": ("--no-enable-chunked-prefill", "--no-chunked-prefill"),
        "help": "prefill prompts in budget-sized chunks (default: on; off: each prompt in one step)"})
    long_prefill_threshold: int = field(default=0, metadata={
        "aliases": ("--long-prefill-token-threshold",),  # vLLM's name
        "help": "largest prefill chunk one request may take in a step (0: the whole budget)"})
    max_wait_steps: int = field(default=0, metadata={
        "help": "starvation bound: admit a request first after this many steps waiting (0: off)"})
    max_wait_seconds: float = field(default=0.0, metadata={
        "help": "starvation bound: admit a request first after this many seconds waiting (0: off)"})
    low_watermark: float = field(default=0.0, metadata={
        "help": "watermark policy: below this fraction of the KV pool in use, admit whenever the "
                "first chunk fits"})
    high_watermark: float = field(default=1.0, metadata={
        "help": "watermark policy: at or above this fraction of the KV pool in use, admit nothing"})
    trace: bool = field(default=False, metadata={"help": "record the scheduler's decisions"})
    trace_capacity: int = field(default=10000, metadata={
        "help": "steps the decision record keeps (the oldest are dropped)"})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("long_prefill_threshold", "max_wait_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {self.scheduling!r}")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1, got "
                f"low_watermark={self.low_watermark}, high_watermark={self.high_watermark}"
            )


SPECULATIVE_METHODS = ("ngram", "draft", "layer_skip")  # kvloom/speculative/proposer.py PROPOSERS
# The step size, in tokens, up to which speculation runs (SpeculativeConfig.max_batched_tokens):
# below it a CPU decode step is bound by streaming the weights, so verifying drafts costs
# little; above it the step is compute-bound and drafts cost nearly what they save
# (docs/benchmarks.md, "Speculative decoding", measured on AMD EPYC).
DEFAULT_SPECULATIVE_MAX_BATCHED_TOKENS = 32
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "model", "num_layers", "max_batched_tokens", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys: a proposer guesses up to
    ``num_speculative_tokens`` tokens per request, the model verifies them in one chunk.

    ``ngram``: prompt lookup (the last ``prompt_lookup_max`` .. ``prompt_lookup_min``
    tokens matched against the request's own tokens); ``draft``: a smaller ``model``
    with the same vocabulary; ``layer_skip``: the target's first ``num_layers`` layers,
    final norm and head (self-speculation, sharing the weights)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    num_layers: int | None = None
    # Drafts are added to a step only while it stays within this many tokens (decodes,
    # chunks and drafts together): the rule that turns speculation off for big batches.
    max_batched_tokens: int = DEFAULT_SPECULATIVE_MAX_BATCHED_TOKENS
    # Per request, propose fewer tokens when few are accepted (engine/speculation.py).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} > {self.prompt_lookup_max}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model (the draft model's path) is required for "
                             "method 'draft'")
        if self.method != "draft" and self.model is not None:
            raise ValueError(f"speculative_config.model is only for method 'draft', not {self.method!r}")
        if self.method == "layer_skip":
            if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) \
                    or self.num_layers <= 0:
                raise ValueError("speculative_config.num_layers (how many of the target's layers the "
                                 f"draft runs) must be a positive integer, got {self.num_layers!r}")
        elif self.num_layers is not None:
            raise ValueError(f"speculative_config.num_layers is only for method 'layer_skip', "
                             f"not {self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict (``LLM(speculative_config={...})``) or its JSON text (the flag)."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{list(_SPECULATIVE_KEYS)}")
        if "method" not in value:
            raise ValueError(f"speculative_config.method is required: one of {SPECULATIVE_METHODS}")
        return cls(**value)


def parse_hf_overrides(value: Any) -> dict[str, Any]:
    """``--hf-overrides``: JSON text or a dict, keyed by config.json's names."""
    value = json_object(value, "hf_overrides")
    if not all(isinstance(key, str) and key for key in value):
        raise ValueError(f"hf_overrides must be a JSON object keyed by config.json's names, got {value!r}")
    return dict(value)


def parse_pooler_config(value: Any) -> dict[str, Any]:
    """``--pooler-config``: JSON text or a dict with vLLM's PoolerConfig keys, checked now
    (a bad key or value is refused before the model loads)."""
    value = dict(json_object(value, "pooler_config"))
    PoolerConfig.from_hf({"pooler_config": value})
    return value


def with_hf_overrides(hf: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf`` (a config.json) with ``overrides`` set over it; a dict value merges into the
    dict it replaces (``rope_scaling``, a sub-config), key by key, as vLLM merges them."""
    merged = dict(hf)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = with_hf_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's value: JSON text that must make a valid SpeculativeConfig (checked
    before any model loads)."""
    return SpeculativeConfig.parse(text)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine. CLI flags map 1:1 onto these names."""

    # Every field below (and those of its sections, cache and scheduler) is an engine option:
    # an LLM(...) keyword and a CLI flag of the same name, with this help (see ENGINE_OPTIONS).
    model: str = field(default=DEFAULT_MODEL, metadata={
        "flag": "model", "aliases": ("--model",),
        "help": f"HF directory, .gguf file, Hugging Face model id ORG/NAME (from the Hugging Face cache, "
                f"downloaded there when missing), or {DEFAULT_MODEL!r} (default); as MODEL or --model"})
    revision: str | None = field(default=None, metadata={
        "help": "revision of a Hugging Face model id: a branch, tag or commit hash (default: main)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "a Hugging Face directory whose tokenizer (tokenizer.json, tokenizer_config.json, "
                "chat_template.jinja) replaces the model's, as vLLM's --tokenizer: e.g. the base model's "
                "for a .gguf (default: the model's own)"})
    dtype: str = field(default="auto", metadata={
        "choices": SUPPORTED_DTYPES, "help": "weight and activation dtype; auto means bfloat16"})
    device: str = field(default="auto", metadata={
        "parse": parse_device, "help": "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."})
    seed: int = field(default=0, metadata={
        "help": "random seed: seeds the sampler of requests that bring no seed of their own"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length, prompt + output (default and cap: the model's)"})
    max_logprobs: int = field(default=20, metadata={
        "help": "the most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
                "beam search's rounds ask for twice the beam width); -1: the whole vocabulary (default 20, "
                "vLLM's)"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "auto: the C++ paged kernel (cpu_paged) on CPU when it builds, the Triton kernels "
                "(triton) on CUDA when triton is installed, else torch_ref; for latent attention (DeepSeek) the C++ "
                "kernel (mla_cpu) on CPU, else mla_batched; "
                "on CUDA also flashinfer or flash_attn (block sizes of a multiple of 256) when installed"})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch CPU threads (default: torch's choice)"})
    # models/packed_linear.py holds the kernels.
    matmul: str = field(default="invariant", metadata={
        "choices": MATMULS,
        "help": "kernel for CPU bf16 matmuls: 'invariant' (kvloom's GEMM: a request's tokens never "
                "depend on the batch), 'onednn' (prepacked oneDNN: rounding changes with the batch "
                "size), 'torch' (F.linear, for comparison)"})
    decoder_stack: str = field(default="native", metadata={
        "choices": DECODER_STACKS,
        "help": "how the decoder layers run: 'native' (one C++ call walks every layer through the "
                "same kernels, bit-identical, without the Python between them; CPU bf16 with the "
                "invariant matmul and the paired KV layout, or for latent attention the mla_cpu "
                "backend, else the modules run) or 'modules' "
                "(the nn.Module path, the reference)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly instead of replaying decode steps from CUDA graphs "
                "captured at start (runner/cuda_graphs.py); no effect on CPU"})
    overlap_scheduling: str = field(default="auto", metadata={
        "choices": OVERLAP_MODES,
        "help": "schedule and launch each step before the previous one's tokens reach the host, "
                "so the CPU's work (scheduling, batch building, detokenizing) overlaps the device's "
                "forward: 'auto' on CUDA, 'on' also on CPU (no gain there: the CPU is the device), "
                "'off'; refused with speculative decoding, tensor parallel, disaggregation and "
                "static batching (engine/overlap.py)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "chat template instead of the tokenizer's: a file path or an inline Jinja template"})
    generation_config: str = field(default="auto", metadata={
        "help": "sampling defaults for requests that set none: 'auto' reads the model "
                "directory's generation_config.json if any, 'vllm' or 'none' ignores it, a "
                "directory reads that one's"})
    # hash=False: a dict (the config stays hashable).
    hf_overrides: dict[str, Any] | None = field(default=None, hash=False, metadata={
        "parse": parse_hf_overrides, "flag_type": str,
        "help": "keys of the model's Hugging Face config.json set over its own, as JSON (vLLM's), e.g. "
                "'{\"is_matryoshka\": true}' or '{\"max_position_embeddings\": 4096}'; a dict value is "
                "merged into the config's dict of that key"})
    pooler_config: dict[str, Any] | None = field(default=None, hash=False, metadata={
        "parse": parse_pooler_config, "flag_type": str,
        "help": "how embeddings are pooled, as JSON with vLLM's PoolerConfig keys: pooling_type (LAST, the "
                "default for decoders; MEAN; CLS), use_activation (false: not normalized), e.g. "
                "'{\"pooling_type\": \"MEAN\"}'; over a sentence-transformers model's own (modules.json)"})
    override_generation_config: dict[str, Any] | None = field(default=None, hash=False, metadata={
        "parse": parse_override, "flag_type": str,
        "help": "sampling defaults over --generation-config's, as JSON with generation_config.json's keys, "
                "e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 128}' (vLLM's; with --generation-config "
                "vllm, these alone)"})
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "parse": parse_speculative_config, "flag_type": str,
        "help": "speculative decoding as JSON, vLLM's keys: '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', 'draft' with a "
                "\"model\", 'layer_skip' with \"num_layers\" (default: off)"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"revision must be a non-empty string (a branch, tag or commit hash), "
                             f"got {self.revision!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer.strip()):
            raise ValueError(f"tokenizer must be a directory's path, got {self.tokenizer!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.decoder_stack not in DECODER_STACKS:
            raise ValueError(f"decoder_stack must be one of {DECODER_STACKS}, got {self.decoder_stack!r}")
        if self.overlap_scheduling not in OVERLAP_MODES:
            raise ValueError(f"overlap_scheduling must be one of {OVERLAP_MODES}, got {self.overlap_scheduling!r}")
        parse_device(self.device)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or self.num_threads <= 0):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.chat_template is not None:
            from kvloom.tokenizer import resolve_chat_template
            resolve_chat_template(self.chat_template)  # a missing file fails before loading
        if not isinstance(self.generation_config, str) or not (
                self.generation_config in GENERATION_CONFIG_MODES
                or (Path(self.generation_config).expanduser() / "generation_config.json").is_file()):
            raise ValueError("generation_config must be 'auto', 'vllm', 'none' or a directory "
                             f"holding generation_config.json, got {self.generation_config!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, "
                             f"got {self.max_logprobs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        if self.pooler_config is not None:
            object.__setattr__(self, "pooler_config", parse_pooler_config(self.pooler_config))
        if self.override_generation_config is not None:
            object.__setattr__(self, "override_generation_config", parse_override(self.override_generation_config))
        if self.speculative_config is not None:
            # A dict (LLM keyword) or JSON text (the flag) becomes the frozen config.
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
            if self.speculative_config.method == "layer_skip" and self.parallel.tensor_parallel_size > 1:
                raise ValueError("speculative_config method 'layer_skip' drafts with the target's own "
                                 "layers, which tensor_parallel_size > 1 shards across ranks: use "
                                 "'ngram' or 'draft' with tensor parallel")

        if self.kv_transfer.role == "disaggregated":
            raise ValueError("role 'disaggregated' starts several processes: it is `kvloom serve --role "
                             "disaggregated`; one engine is 'both', 'prefill' or 'decode'")
        if self.kv_transfer.role != "both" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(f"role {self.kv_transfer.role!r} with tensor_parallel_size > 1 is not "
                             "supported: each rank would move its own heads' blocks")

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(num_blocks=...)``, CLI flags): each
        goes to the section ``ENGINE_OPTIONS`` names for it."""
        sections: dict[str | None, dict[str, Any]] = {None: {"model": model}}
        for key, value in kwargs.items():
            option = _OPTIONS_BY_NAME.get(key)
            if option is None or key == "model":
                raise TypeError(f"unknown engine argument {key!r}")
            sections.setdefault(option.section, {})[key] = value
        own = sections.pop(None)
        return cls(**own, **{name: _SECTIONS[name](**values) for name, values in sections.items()})


@dataclass(frozen=True)
class EngineOption:
    """One engine option: a field of ``EngineConfig`` or of one of its sections (cache,
    scheduler), under the flat name that ``LLM(...)`` keywords and CLI flags share.
    The field's metadata holds its ``help``, and ``choices`` or a ``flag`` spelling
    where it has them (kvloom/engine_args.py turns them into argparse flags)."""

    name: str
    section: str | None  # the EngineConfig field that holds it; None: EngineConfig's own
    type: Any  # the resolved annotation: int, int | None, str, bool, ...
    field: Any  # the dataclasses.Field: default and metadata

    @property
    def default(self) -> Any:
        return self.field.default


def _engine_options() -> tuple[tuple[EngineOption, ...], dict[str, type]]:
    """Walk EngineConfig: a field whose type is a dataclass is a section, the rest are
    options. Flat names must be unique: ``LLM(block_size=...)`` names one field."""
    options: list[EngineOption] = []
    sections: dict[str, type] = {}
    engine_hints = typing.get_type_hints(EngineConfig)
    for owner_field in dataclasses.fields(EngineConfig):
        owner_type = engine_hints[owner_field.name]
        if dataclasses.is_dataclass(owner_type):
            sections[owner_field.name] = owner_type
            hints = typing.get_type_hints(owner_type)
            options += [EngineOption(f.name, owner_field.name, hints[f.name], f)
                        for f in dataclasses.fields(owner_type)]
        else:
            options.append(EngineOption(owner_field.name, None, owner_type, owner_field))
    names = [option.name for option in options]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise TypeError(f"engine options must have unique names, got duplicates {duplicates}")
    return tuple(options), sections


# Every engine option in declaration order; LLM(...), EngineConfig.from_kwargs and the CLI's
# engine flags all derive from it, so a new config field is one edit.
ENGINE_OPTIONS, _SECTIONS = _engine_options()
_OPTIONS_BY_NAME = {option.name: option for option in ENGINE_OPTIONS}
