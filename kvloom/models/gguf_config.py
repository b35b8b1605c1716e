"""GGUF metadata -> an HF ``config.json`` dict (``gguf_hf_config``), per family.

``general.architecture`` names the family, its ``<arch>.*`` keys the shape: llama /
mistral (Mixtral where the file has experts), qwen2, qwen2moe, qwen3, qwen3moe, deepseek2 (DeepSeek-V3
where the router is sigmoid-gated, else V2), mamba2 and granitehybrid (Bamba or Granite 4.0), nemotron_h, phi3,
granite, granitemoe, gemma, gemma2, gemma3, olmo2 (OLMo 2, and OLMo 3 where it has a window pattern),
starcoder2, phi2 (Phi-1, 1.5 and 2), gptneox (Pythia), gpt2, stablelm, smollm3, ernie4_5 (dense),
exaone4, olmo (OLMo 1); where the metadata is silent, the tensors' names and shapes fill in (gguf_loader.py maps
the tensors themselves).

What a file does not record is read as llama.cpp runs it: no normalisation of the
top-k weights unless ``expert_weights_norm`` (Qwen2-MoE's norm_topk_prob is not
stored), one expert group unless ``expert_group_count``, a MoE in every layer that
has ``ffn_gate_inp`` (DeepSeek's moe_layer_freq 1, Qwen2-MoE's dense layers from the
tensors), Mamba2's and Bamba's time_step_limit none and their SSD chunk size HF's
default (256, which only changes how the scan rounds); YaRN's mscale is taken equal to
mscale_all_dim (DeepSeek's files keep one of them; every published V2/V3 has them
equal). granitehybrid holds two HF families, their attention layers those with a nonzero per-layer
``attention.head_count_kv``: Bamba (rope over half of each head, no multipliers, no
experts), and IBM Granite 4.0 (GraniteMoeHybrid), told apart by what only Granite 4.0 has:
experts beside a shared MLP, an embedding / residual / attention / logit multiplier that
changes the model, or no rope (llama.cpp's converter writes ``rope.scaling.finetuned``
false for every Granite 4.0 hybrid and runs it without rope, so kvloom reads it so). A
file that contradicts its family is refused with a ModelLoadError naming what
is missing, and so is every architecture gguf knows that kvloom does not serve (deepseek,
mamba, qwen3next, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvloom.models.errors import ModelLoadError

# GGUF general.architecture -> HF architectures[0] of its dense family (a llama or mistral
# file with experts is Mixtral; a deepseek2 file with sigmoid gating DeepSeek-V3).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
    "mamba2": "Mamba2ForCausalLM", "granitehybrid": "BambaForCausalLM", "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # OLMo 3 too, where the file has a window pattern
    "starcoder2": "Starcoder2ForCausalLM", "phi2": "PhiForCausalLM", "gptneox": "GPTNeoXForCausalLM",
    "gpt2": "GPT2LMHeadModel", "stablelm": "StableLmForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",  # NoPE every fourth layer, as llama.cpp takes it (the file does not say)
    "ernie4_5": "Ernie4_5ForCausalLM", "exaone4": "Exaone4ForCausalLM", "olmo": "OlmoForCausalLM",
    "nemotron": "NemotronForCausalLM", "falcon": "FalconForCausalLM", "arcee": "ArceeForCausalLM",
    "gpt-oss": "GptOssForCausalLM", "lfm2": "Lfm2ForCausalLM", "lfm2moe": "Lfm2MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM", "nemotron_h_moe": "NemotronHForCausalLM",  # the second Nemotron 3's
}

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3", "Mamba2ForCausalLM": "mamba2", "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite", "GraniteMoeForCausalLM": "granitemoe",
    "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3", "Starcoder2ForCausalLM": "starcoder2",
    "PhiForCausalLM": "phi", "GPTNeoXForCausalLM": "gpt_neox", "GPT2LMHeadModel": "gpt2",
    "StableLmForCausalLM": "stablelm", "SmolLM3ForCausalLM": "smollm3", "Ernie4_5ForCausalLM": "ernie4_5",
    "Exaone4ForCausalLM": "exaone4", "OlmoForCausalLM": "olmo", "NemotronForCausalLM": "nemotron",
    "FalconForCausalLM": "falcon", "ArceeForCausalLM": "arcee", "GptOssForCausalLM": "gpt_oss",
    "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2_moe", "NemotronHForCausalLM": "nemotron_h",
}

_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID (1: softmax, what an absent key means)

_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
# A router, routed experts or a shared expert: Granite 4.0's MoE, which Bamba lacks.
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(?:gate_inp|\w+_exps|\w+_shexp)\.")
# Granite's multipliers: the converter writes each only where the HF config has it
# (Granite 4.0's, not Bamba's).
_GRANITE_SCALES = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")

Meta = Callable[..., Any]  # meta(key[, default]): "<arch>.<key>"; KeyError naming it if absent and no default


def gguf_architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    return str(arch)


def gguf_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """Synthesize a config.json-like dict from ``<arch>.*`` metadata (and, where the
    metadata is silent, the tensors' names and shapes)."""
    arch = gguf_architecture(reader, path)
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # innermost first

    def meta(key: str, default: Any = ...) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is ...:
            raise KeyError(f"{arch}.{key}")
        return value

    try:
        if arch == "mamba2":
            config = _mamba2_config(meta, shapes)
        elif arch == "granitehybrid":
            config = _granite_hybrid_config(meta, shapes, path)
        elif arch in ("lfm2", "lfm2moe"):
            config = _lfm2_config(meta, shapes, path, moe=arch == "lfm2moe")
        elif arch in ("nemotron_h", "nemotron_h_moe"):
            config = _nemotron_h_config(meta, shapes, path, moe=arch == "nemotron_h_moe")
        else:
            config = _attention_config(arch, meta, shapes, path)
    except (TypeError, KeyError) as exc:
        raise ModelLoadError(f"GGUF file {path} lacks required metadata ({exc})") from None
    config["model_type"] = _MODEL_TYPES[config["architectures"][0]]
    config["rope_scaling"] = _rope_scaling(reader, arch, config, path)
    return config


def _falcon_gguf_fields(config: dict[str, Any], meta: Meta, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Falcon's config.json fields from a llama.cpp file: one KV head is Falcon-7B's multi-query
    layout; more are the new architecture's KV groups, with two norms side by side where the
    file has ``attn_norm_2`` (Falcon-40B / 180B) and one otherwise (Falcon2-11B); the MLP's width
    from its tensor (the converter writes 4 x hidden)."""
    kv_heads = config["num_key_value_heads"]
    return {"num_kv_heads": kv_heads, "multi_query": kv_heads == 1, "new_decoder_architecture": kv_heads > 1,
            "parallel_attn": True, "num_ln_in_parallel_attn": 2 if "blk.0.attn_norm_2.weight" in shapes else 1,
            "bias": "blk.0.attn_qkv.bias" in shapes,
            "layer_norm_epsilon": float(meta("attention.layer_norm_epsilon", 1e-5)),
            "ffn_hidden_size": shapes["blk.0.ffn_up.weight"][1], "alibi": False}


def _attention_config(arch: str, meta: Meta, shapes: dict[str, list[int]], path: Path) -> dict[str, Any]:
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "intermediate_size": int(meta("feed_forward_length")),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        # GGUF shapes are innermost-first: token_embd is [hidden, vocab].
        "vocab_size": shapes["token_embd.weight"][-1],
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen2moe"):
        config["attention_bias"] = True
    if arch in ("granite", "granitemoe"):  # its multipliers, where the converter wrote them
        for key, field in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                           ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling")):
            value = meta(key, None)
            if value is not None:
                config[field] = float(value)
    if arch == "phi3":  # the fused q/k/v: its row count is q's plus two kv heads' worth
        rope_dims = int(meta("rope.dimension_count", config["head_dim"]))
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
    window = meta("attention.sliding_window", None)
    if window:
        config["sliding_window"] = int(window)
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_fields(arch, meta, config))
    if arch == "starcoder2":  # LayerNorm's eps; one bias flag for every projection, from the tensors
        config["norm_epsilon"] = float(meta("attention.layer_norm_epsilon", 1e-5))
        config["use_bias"] = "blk.0.attn_q.bias" in shapes
        config["hidden_act"] = "gelu_pytorch_tanh"  # StarCoder2's (the file names none; ggml's GELU is this form)
    if arch in ("phi2", "gptneox", "stablelm"):  # LayerNorm's eps, and the rotary's dims of a head
        config["layer_norm_eps"] = float(meta("attention.layer_norm_epsilon", 1e-5))
        config["partial_rotary_factor"] = int(meta("rope.dimension_count", config["head_dim"])) / config["head_dim"]
    if arch == "phi2":  # as llama.cpp's Phi2Model writes it
        config["hidden_act"] = "gelu_new"  # ggml's GELU: the tanh form
        # The converter writes 4 x hidden as the MLP's width and every head as a KV head;
        # the tensors say what they are.
        config["intermediate_size"] = shapes["blk.0.ffn_up.weight"][1]
        if "blk.0.attn_k.weight" in shapes:
            config["num_key_value_heads"] = shapes["blk.0.attn_k.weight"][1] // config["head_dim"]
    if arch == "gptneox":  # as llama.cpp's GPTNeoXModel writes it
        config["use_parallel_residual"] = bool(meta("use_parallel_residual", True))
        config["attention_bias"] = "blk.0.attn_qkv.bias" in shapes
        # Every GPT-NeoX checkpoint's (Pythia's, NeoX-20B's) activation: GELU exactly, as
        # transformers runs it (llama.cpp's ggml_gelu is the tanh form).
        config["hidden_act"] = "gelu"
    if arch == "falcon":  # as llama.cpp's FalconModel writes it: its graph is always side by side
        config.update(_falcon_gguf_fields(config, meta, shapes))
    if arch == "arcee":  # llama.cpp's ArceeModel is its LlamaModel (q/k rows permuted) with an un-gated MLP
        config["hidden_act"] = "relu2"  # every AFM's (the file names none)
    if arch == "nemotron":  # as llama.cpp's NemotronModel writes it (its LayerNorm1P weights stored plus one)
        config["norm_eps"] = float(meta("attention.layer_norm_epsilon", 1e-5))
        config["partial_rotary_factor"] = int(meta("rope.dimension_count", config["head_dim"])) / config["head_dim"]
        config["hidden_act"] = "relu2"  # every Nemotron's (the file names none)
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    if arch == "olmo" and meta("attention.clamp_kqv", None) is not None:  # OLMo 1's clip_qkv
        config["clip_qkv"] = float(meta("attention.clamp_kqv"))
    if arch == "ernie4_5":  # one bias flag for every projection, from the tensors
        config["use_bias"] = "blk.0.attn_q.bias" in shapes
    if arch == "stablelm":  # as llama.cpp's StableLMModel writes it (a parallel residual where the config named none)
        config["use_parallel_residual"] = bool(meta("use_parallel_residual", True))
        config["use_qkv_bias"] = "blk.0.attn_q.bias" in shapes
        config["qk_layernorm"] = "blk.0.attn_q_norm.weight" in shapes
    if arch == "gpt2":  # in GPT-2's own config names (ModelConfig.from_hf reads those); the MLP's width from its tensor
        config.update(n_embd=hidden, n_head=num_heads, n_layer=config["num_hidden_layers"],
                      n_positions=config["max_position_embeddings"], n_inner=shapes["blk.0.ffn_up.weight"][1],
                      activation_function="gelu_new",
                      layer_norm_epsilon=float(meta("attention.layer_norm_epsilon", 1e-5)))
    pattern = meta("attention.sliding_window_pattern", None)
    if arch == "olmo2" and pattern is not None:  # OLMo 3: its windowed layers, as llama.cpp's converter lists them
        if meta("rope.scaling.type", None) is not None:
            raise ModelLoadError(f"GGUF file {path}: an OLMo 3 file with rope scaling is not read (whether its "
                                 "windowed layers scale their rotary too is not recorded)")
        config["architectures"] = ["Olmo3ForCausalLM"]
        config["layer_types"] = ["sliding_attention" if bool(one) else "full_attention" for one in pattern]
    if arch == "exaone4" and pattern is not None:  # its windowed layers, as llama.cpp's converter lists them
        config["layer_types"] = ["sliding_attention" if bool(one) else "full_attention" for one in pattern]
    sparse = sorted(int(m.group(1)) for name in shapes if (m := _ROUTER.fullmatch(name)))
    if arch == "gpt-oss":
        config.update(_gpt_oss_fields(meta, config))
    elif arch == "deepseek2":
        config.update(_deepseek_fields(meta, shapes, config, sparse, path))
    elif arch == "qwen2moe":
        config.update(_qwen2_moe_fields(meta, shapes, config, sparse, path))
    elif arch == "qwen3moe":
        config.update(_qwen3_moe_fields(meta, shapes, config, sparse))
    elif arch == "granitemoe":  # Mixtral's routing in every layer; the experts' width from their tensors
        config.update({"num_local_experts": int(meta("expert_count")),
                       "num_experts_per_tok": int(meta("expert_used_count")),
                       "intermediate_size": shapes["blk.0.ffn_gate_exps.weight"][1]})
    elif sparse:
        config.update(_mixtral_fields(meta, config, sparse, path))
    return config


# Gemma 2 and 3 as llama.cpp runs them (their files do not record it): windowed layers
# in a fixed pattern (Gemma 2 every other layer from the first, Gemma 3 five in every six),
# Gemma 3's windowed layers turning the rotary at 10,000, and attention scaled by
# head_dim ** -0.5 but in the 27B models (46 and 62 layers), by (hidden / heads) ** -0.5.
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gpt_oss_fields(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS as llama.cpp's GptOssModel writes it and runs it: biases on q/k/v/o, every
    layer's experts ``expert_feed_forward_length`` wide, a window on every other layer from
    the first (llama.cpp's swa pattern 2, transformers' layer_types), the clamped SwiGLU at
    its fixed 1.702 and 7.0 (the file records neither)."""
    layers = config["num_hidden_layers"]
    return {"attention_bias": True, "num_local_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "intermediate_size": int(meta("expert_feed_forward_length")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _gemma_fields(arch: str, meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    layers, pattern = config["num_hidden_layers"], _GEMMA_WINDOW_PATTERN[arch]
    scalar = (config["hidden_size"] // config["num_attention_heads"] if layers == _GEMMA_27B_LAYERS[arch]
              else config["head_dim"])
    fields: dict[str, Any] = {
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "layer_types": ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)],
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = meta("attn_logit_softcapping", None)
    else:
        fields["rope_local_base_freq"] = 10000.0
    return fields


def _mixtral_fields(meta: Meta, config: dict[str, Any], sparse: list[int], path: Path) -> dict[str, Any]:
    """A llama / mistral file with experts: Mixtral, a softmax-routed MoE in every layer."""
    if sparse != list(range(config["num_hidden_layers"])) or meta("expert_shared_count", 0) \
            or int(meta("expert_gating_func", 1)) == _SIGMOID:
        raise ModelLoadError(f"GGUF file {path}: a llama-family MoE is read as Mixtral (softmax routing over "
                             f"experts in every layer, no shared expert); this one has experts in layers {sparse}, "
                             f"expert_shared_count {meta('expert_shared_count', 0)}, expert_gating_func "
                             f"{meta('expert_gating_func', 1)}")
    return {"architectures": ["MixtralForCausalLM"], "num_local_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count"))}


def _qwen2_moe_fields(meta: Meta, shapes: dict[str, list[int]], config: dict[str, Any], sparse: list[int],
                      path: Path) -> dict[str, Any]:
    """Qwen2-MoE: its dense layers (mlp_only_layers) are those without a router."""
    if int(meta("expert_gating_func", 1)) == _SIGMOID:
        raise ModelLoadError(f"GGUF file {path}: qwen2moe with sigmoid expert gating is not Qwen2-MoE (softmax)")
    fields: dict[str, Any] = {"decoder_sparse_step": 1, "norm_topk_prob": bool(meta("expert_weights_norm", False)),
                              "mlp_only_layers": [i for i in range(config["num_hidden_layers"]) if i not in sparse]}
    if not sparse:
        return {**fields, "num_experts": 0}
    first = f"blk.{sparse[0]}"
    if f"{first}.ffn_up_shexp.weight" not in shapes or f"{first}.ffn_gate_inp_shexp.weight" not in shapes:
        raise ModelLoadError(f"GGUF file {path}: Qwen2-MoE needs the shared expert and its gate "
                             f"({first}.ffn_up_shexp / ffn_gate_inp_shexp), which the file lacks")
    # [hidden, features(, experts)] innermost first: the metadata where present, else the tensors.
    return {**fields, "num_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length", shapes[f"{first}.ffn_up_exps.weight"][1])),
            "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length",
                                                        shapes[f"{first}.ffn_up_shexp.weight"][1]))}


def _qwen3_moe_fields(meta: Meta, shapes: dict[str, list[int]], config: dict[str, Any],
                      sparse: list[int]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen2-MoE's routing without a shared expert; llama.cpp's qwen3moe graph
    always renormalises the top-k weights (every published Qwen3-MoE has norm_topk_prob),
    and its dense layers (mlp_only_layers) are those without a router."""
    fields: dict[str, Any] = {"decoder_sparse_step": 1, "norm_topk_prob": True,
                              "mlp_only_layers": [i for i in range(config["num_hidden_layers"]) if i not in sparse]}
    if not sparse:
        return {**fields, "num_experts": 0}
    first = f"blk.{sparse[0]}"
    return {**fields, "num_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length", shapes[f"{first}.ffn_up_exps.weight"][1]))}


def _deepseek_fields(meta: Meta, shapes: dict[str, list[int]], config: dict[str, Any], sparse: list[int],
                     path: Path) -> dict[str, Any]:
    """DeepSeek-V2/V3: latent attention's sizes, the MoE after the leading dense layers."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    rank, rope = meta("attention.kv_lora_rank", None), meta("rope.dimension_count", None)
    if not rank or not rope:
        raise ModelLoadError(f"GGUF file {path}: deepseek2 needs attention.kv_lora_rank and rope.dimension_count "
                             "(multi-head latent attention), which the file lacks")
    # Newer files: per-head sizes in *_mla (key_length is then the latent's); older: key_length.
    qk_head = int(meta("attention.key_length_mla", None) or meta("attention.key_length"))
    v_head = int(meta("attention.value_length_mla", None) or meta("attention.value_length"))
    query = "blk.0.attn_q.weight" if "blk.0.attn_q.weight" in shapes else "blk.0.attn_q_b.weight"
    if shapes[query][1] != heads * qk_head or shapes["blk.0.attn_output.weight"][0] != heads * v_head:
        raise ModelLoadError(f"GGUF file {path}: key/value lengths ({qk_head}, {v_head} per head) disagree with "
                             f"the shapes of {query} and blk.0.attn_output")
    # Without experts every layer is dense, whatever leading_dense_block_count says.
    first_dense = int(meta("leading_dense_block_count", 0)) if sparse else layers
    v3 = int(meta("expert_gating_func", 1)) == _SIGMOID
    fields: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": heads,  # llama.cpp's head_count_kv 1 is its latent trick
        "head_dim": int(rope), "kv_lora_rank": int(rank), "q_lora_rank": meta("attention.q_lora_rank", None) or None,
        "qk_rope_head_dim": int(rope), "qk_nope_head_dim": qk_head - int(rope), "v_head_dim": v_head,
        "first_k_dense_replace": first_dense, "moe_layer_freq": 1,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in shapes,
    }
    if v3:
        fields["rope_interleave"] = True  # llama.cpp's rotary pairs adjacent numbers, V3's default
    if sparse:
        biased = all(f"blk.{i}.exp_probs_b.bias" in shapes for i in sparse)
        if sparse != list(range(first_dense, layers)) or biased != v3:
            raise ModelLoadError(f"GGUF file {path}: deepseek2's MoE must fill the layers from "
                                 f"leading_dense_block_count ({first_dense}) on, with exp_probs_b exactly when "
                                 f"gating is sigmoid (V3); this file has experts in layers {sparse}, exp_probs_b "
                                 f"{'in all of them' if biased else 'missing'}, gating "
                                 f"{'sigmoid' if v3 else 'softmax'}")
    elif not meta("expert_count", 0):  # a dense model: MoE fields for no sparse layer
        return {**fields, "n_routed_experts": 1, "num_experts_per_tok": 1}
    groups, used_groups = int(meta("expert_group_count", 1)), int(meta("expert_group_used_count", 1))
    method = "noaux_tc" if v3 else ("group_limited_greedy" if used_groups < groups else "greedy")
    return {**fields, "n_routed_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "n_shared_experts": int(meta("expert_shared_count", 0)),
            "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(meta("expert_weights_norm", False)), "n_group": groups, "topk_group": used_groups,
            "topk_method": method, "scoring_func": "sigmoid" if v3 else "softmax"}


def _mamba2_config(meta: Meta, shapes: dict[str, list[int]]) -> dict[str, Any]:
    hidden, inner, heads = (int(meta(k)) for k in ("embedding_length", "ssm.inner_size", "ssm.time_step_rank"))
    if inner % hidden or inner % heads:
        raise ModelLoadError(f"mamba2 GGUF: ssm.inner_size {inner} must be a multiple of embedding_length {hidden} "
                             f"and of ssm.time_step_rank (the heads) {heads}")
    return {"architectures": ["Mamba2ForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": int(meta("block_count")),
            "vocab_size": shapes["token_embd.weight"][-1], "num_heads": heads, "head_dim": inner // heads,
            "expand": inner // hidden, "state_size": int(meta("ssm.state_size")),
            "n_groups": int(meta("ssm.group_count", 1)), "conv_kernel": int(meta("ssm.conv_kernel")),
            "layer_norm_epsilon": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            "use_conv_bias": "blk.0.ssm_conv1d.bias" in shapes, "use_bias": "blk.0.ssm_in.bias" in shapes,
            "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32"}


def _granite_hybrid_config(meta: Meta, shapes: dict[str, list[int]], path: Path) -> dict[str, Any]:
    """granitehybrid: Mamba2 mixers in the layers whose head_count_kv is 0, Llama attention
    in the others, a gated MLP (or Granite 4.0's experts beside one) after each; Granite
    4.0's config where the file shows one of its signs (``_granite_4_signs``), else Bamba's
    (rope over half of each head)."""
    layers, hidden = int(meta("block_count")), int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    attention, kv_heads = _hybrid_layers(meta("attention.head_count_kv"), layers, path)
    inner, ssm_heads = int(meta("ssm.inner_size")), int(meta("ssm.time_step_rank"))
    if inner % hidden or inner % ssm_heads:
        raise ModelLoadError(f"granitehybrid GGUF {path}: ssm.inner_size {inner} must be a multiple of "
                             f"embedding_length {hidden} and of ssm.time_step_rank (the mamba heads) {ssm_heads}")
    first_attention = f"blk.{attention[0]}"
    first_mamba = f"blk.{next(i for i in range(layers) if i not in attention)}"
    config = {"hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": num_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "vocab_size": shapes["token_embd.weight"][-1],
              "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
              "rope_theta": float(meta("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(meta("context_length")),
              "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads, "mamba_expand": inner // hidden,
              "mamba_d_state": int(meta("ssm.state_size")), "mamba_n_groups": int(meta("ssm.group_count", 1)),
              "mamba_d_conv": int(meta("ssm.conv_kernel")),
              "mamba_conv_bias": f"{first_mamba}.ssm_conv1d.bias" in shapes,
              "mamba_proj_bias": f"{first_mamba}.ssm_in.bias" in shapes,
              "attention_bias": f"{first_attention}.attn_q.bias" in shapes,
              "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32"}
    if _granite_4_signs(meta, shapes, head_dim):
        return {**config, **_granite_4_fields(meta, shapes, head_dim, attention, layers, path)}
    # The converter writes head_dim (it does not know Bamba's partial_rotary_factor), or
    # attn_rotary_emb where the HF config has one; transformers rotates half of each head.
    rope = int(meta("rope.dimension_count", head_dim))
    if rope not in (head_dim, head_dim // 2):
        raise ModelLoadError(f"granitehybrid GGUF {path}: rope.dimension_count {rope} is neither head_dim "
                             f"{head_dim} nor its half; Bamba rotates exactly half of each head")
    return {**config, "architectures": ["BambaForCausalLM"], "attn_layer_indices": attention,
            "intermediate_size": int(meta("feed_forward_length")), "mlp_bias": "blk.0.ffn_gate.bias" in shapes}


def _granite_4_signs(meta: Meta, shapes: dict[str, list[int]], head_dim: int) -> list[str]:
    """What marks a granitehybrid file as IBM Granite 4.0's (GraniteMoeHybrid), not Bamba's:
    experts, a multiplier that changes the model, or no rope (llama.cpp reads an absent
    rope.scaling.finetuned as no rope)."""
    signs = []
    if meta("expert_count", None) is not None:  # the converter writes it for Granite 4.0, 0 without experts
        signs.append(f"expert_count {meta('expert_count')}")
    experts = sorted(name for name in shapes if _EXPERT_TENSOR.match(name))
    if experts:
        signs.append(f"expert tensors ({experts[0]}, ...)")
    for key in _GRANITE_SCALES:
        # The value that leaves Bamba's model as it is: 1, or for the attention's the
        # softmax scale it has anyway (llama.cpp takes attention.scale in its place).
        plain = head_dim ** -0.5 if key == "attention.scale" else 1.0
        value = meta(key, None)
        if value is not None and not math.isclose(float(value), plain, rel_tol=1e-6):
            signs.append(f"{key} {value}")
    if not meta("rope.scaling.finetuned", False):
        signs.append("rope.scaling.finetuned false or absent (no rope)")
    return signs


def _granite_4_fields(meta: Meta, shapes: dict[str, list[int]], head_dim: int, attention: list[int],
                      layers: int, path: Path) -> dict[str, Any]:
    """Granite 4.0's own config.json fields: its layer kinds, multipliers, rope or none, and
    its feed-forward block: experts (``ffn_*_exps``, the router ``ffn_gate_inp``) beside the
    shared MLP (``ffn_*_shexp``), or the shared MLP alone as a dense MLP (``ffn_gate``, ...),
    the widths read from those tensors."""
    experts = int(meta("expert_count", 0) or 0)
    if experts:
        wanted = ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_shexp.weight")
        missing = [name for name in wanted if name not in shapes]
        if missing:
            raise ModelLoadError(f"granitehybrid GGUF {path}: expert_count {experts} but no {', '.join(missing)} "
                                 "(Granite 4.0's experts sit beside a shared MLP in every layer)")
        widths = {"intermediate_size": shapes[wanted[0]][1], "shared_intermediate_size": shapes[wanted[1]][1],
                  "num_experts_per_tok": int(meta("expert_used_count"))}
    else:
        if "blk.0.ffn_gate.weight" not in shapes:
            raise ModelLoadError(f"granitehybrid GGUF {path}: Granite 4.0 without experts needs its shared MLP "
                                 "as blk.N.ffn_gate / ffn_up / ffn_down")
        widths = {"intermediate_size": int(meta("feed_forward_length")),
                  "shared_intermediate_size": shapes["blk.0.ffn_gate.weight"][1]}
    return {"architectures": ["GraniteMoeHybridForCausalLM"],
            "layer_types": ["attention" if i in attention else "mamba" for i in range(layers)],
            "position_embedding_type": "rope" if meta("rope.scaling.finetuned", False) else None,
            "embedding_multiplier": float(meta("embedding_scale", 1.0)),
            "residual_multiplier": float(meta("residual_scale", 1.0)),
            "attention_multiplier": float(meta("attention.scale", head_dim ** -0.5)),
            "logits_scaling": float(meta("logit_scale", 1.0)), "num_local_experts": experts, **widths}


def _lfm2_config(meta: Meta, shapes: dict[str, list[int]], path: Path, moe: bool = False) -> dict[str, Any]:
    """lfm2: short convolutions in the layers whose head_count_kv is 0, attention (per-head
    q/k norms) in the others; feed_forward_length is the MLP's width after transformers'
    adjustment (the converter applies it), so none is applied again. lfm2moe (LFM2-MoE, as
    llama.cpp's LFM2MoeModel writes it): the same layers, the first leading_dense_block_count
    with that dense MLP, the rest sigmoid-routed experts (expert_gating_func sigmoid) of
    expert_feed_forward_length features, their selection bias where exp_probs_b is stored,
    renormalised and unscaled (llama.cpp's graph assumes both; the file records neither)."""
    layers, hidden = int(meta("block_count")), int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    attention, kv_heads = _hybrid_layers(meta("attention.head_count_kv"), layers, path, "conv")
    first_conv = next(i for i in range(layers) if i not in attention)
    experts: dict[str, Any] = {}
    if moe:
        dense = int(meta("leading_dense_block_count"))
        gating = int(meta("expert_gating_func", 1))
        if gating != _SIGMOID or not 0 <= dense < layers:
            raise ModelLoadError(f"lfm2moe GGUF {path}: LFM2-MoE routes by sigmoid scores (expert_gating_func "
                                 f"{_SIGMOID}) after 0 to {layers - 1} dense layers; the file has expert_gating_func "
                                 f"{gating} and leading_dense_block_count {dense}")
        experts = {"num_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
                   "moe_intermediate_size": int(meta("expert_feed_forward_length")), "num_dense_layers": dense,
                   "use_expert_bias": f"blk.{dense}.exp_probs_b.bias" in shapes, "norm_topk_prob": True,
                   "routed_scaling_factor": 1.0}
    else:
        experts = {"block_auto_adjust_ff_dim": False}
    return {"architectures": ["Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, **experts,
            "num_attention_heads": num_heads, "num_key_value_heads": kv_heads,
            "head_dim": int(meta("attention.key_length", hidden // num_heads)),
            "layer_types": ["full_attention" if i in attention else "conv" for i in range(layers)],
            "intermediate_size": int(meta("feed_forward_length")),
            "conv_L_cache": int(meta("shortconv.l_cache")),
            "conv_bias": f"blk.{first_conv}.shortconv.in_proj.bias" in shapes,
            "vocab_size": shapes["token_embd.weight"][-1], "norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(meta("rope.freq_base", 1000000.0)),
            "max_position_embeddings": int(meta("context_length")),
            "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32"}


def _nemotron_h_config(meta: Meta, shapes: dict[str, list[int]], path: Path, moe: bool = False) -> dict[str, Any]:
    """nemotron_h: single-mixer blocks, as llama.cpp's NemotronHModel writes them (on its
    GraniteHybridModel): attention where the per-block head_count_kv is nonzero, an MLP where
    the per-block feed_forward_length is, a Mamba2 mixer elsewhere; no rope (context_length
    2**20 is the converter's placeholder, kept as Granite 4.0's is). nemotron_h_moe (Nemotron 3):
    the blocks with a feed_forward_length (the experts' width there) and a router are MoE blocks,
    their experts' and shared expert's sizes, the renormalisation, scale and groups from the
    expert_* keys (sigmoid scores and the selection bias, as llama.cpp's graph routes them); a
    file with groups but no expert_group_used_count (the converter writes none) is refused
    unless it has one group, and a latent MoE projection (moe_latent_size) is refused."""
    layers, hidden = int(meta("block_count")), int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    kv_counts, widths = meta("attention.head_count_kv"), meta("feed_forward_length")
    kv = [int(n) for n in kv_counts] if isinstance(kv_counts, list) else [int(kv_counts)] * layers
    ff = [int(n) for n in widths] if isinstance(widths, list) else [int(widths)] * layers
    if len(kv) != layers or len(ff) != layers or any(k and f for k, f in zip(kv, ff, strict=True)):
        raise ModelLoadError(f"nemotron_h GGUF {path}: attention.head_count_kv and feed_forward_length must be "
                             f"per block ({layers}), never both nonzero in one block; got {kv} and {ff}")
    kinds = ["attention" if k else ("moe" if moe and f"blk.{i}.ffn_gate_inp.weight" in shapes else "mlp") if f
             else "mamba" for i, (k, f) in enumerate(zip(kv, ff, strict=True))]
    experts: dict[str, Any] = _nemotron_h_experts(meta, path) if moe else {}
    if "mamba" not in kinds or len({k for k in kv if k}) > 1 or len({f for f in ff if f}) > 1:
        raise ModelLoadError(f"nemotron_h GGUF {path}: a Nemotron-H needs a Mamba2 block, one KV head count and "
                             f"one MLP width; the file's blocks are {kinds} (head_count_kv {kv}, feed_forward_length "
                             f"{ff})")
    inner, ssm_heads = int(meta("ssm.inner_size")), int(meta("ssm.time_step_rank"))
    if inner % ssm_heads:
        raise ModelLoadError(f"nemotron_h GGUF {path}: ssm.inner_size {inner} must be a multiple of "
                             f"ssm.time_step_rank (the mamba heads) {ssm_heads}")
    block = {kind: f"blk.{kinds.index(kind)}" for kind in set(kinds)}
    eps = meta("attention.layer_norm_rms_epsilon", None)
    return {"architectures": ["NemotronHForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
            "layers_block_type": kinds, "num_attention_heads": num_heads,
            "num_key_value_heads": max(kv) or num_heads,
            "head_dim": int(meta("attention.key_length", hidden // num_heads)),
            "intermediate_size": max(ff), "mlp_hidden_act": "relu2",  # every Nemotron-H's (the file names none)
            "mamba_num_heads": ssm_heads, "mamba_head_dim": inner // ssm_heads,
            "ssm_state_size": int(meta("ssm.state_size")), "n_groups": int(meta("ssm.group_count", 1)),
            "conv_kernel": int(meta("ssm.conv_kernel")),
            "use_conv_bias": f"{block['mamba']}.ssm_conv1d.bias" in shapes,
            "mamba_proj_bias": f"{block['mamba']}.ssm_in.bias" in shapes,
            "attention_bias": "attention" in block and f"{block['attention']}.attn_q.bias" in shapes,
            "mlp_bias": "mlp" in block and f"{block['mlp']}.ffn_up.bias" in shapes, **experts,
            # TextModel writes the config's layer_norm_epsilon as the LayerNorm key
            "layer_norm_epsilon": float(eps if eps is not None else meta("attention.layer_norm_epsilon", 1e-5)),
            "vocab_size": shapes["token_embd.weight"][-1], "max_position_embeddings": int(meta("context_length")),
            "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32"}


def _nemotron_h_experts(meta: Meta, path: Path) -> dict[str, Any]:
    """A nemotron_h_moe file's MoE blocks as config.json names them (NemotronHModel's expert_* keys)."""
    groups = int(meta("expert_group_count", 1))
    used = meta("expert_group_used_count", None)
    if groups > 1 and used is None:
        raise ModelLoadError(f"nemotron_h_moe GGUF {path}: expert_group_count {groups} without "
                             "expert_group_used_count: the groups a token may choose from are not recorded")
    if meta("moe_latent_size", None) is not None:
        raise ModelLoadError(f"nemotron_h_moe GGUF {path}: a latent MoE projection (moe_latent_size) is not "
                             "supported")
    return {"n_routed_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "moe_shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length")),
            "n_shared_experts": int(meta("expert_shared_count", 1)),
            "norm_topk_prob": bool(meta("expert_weights_norm", False)),
            "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)), "n_group": groups,
            "topk_group": int(used) if used is not None else 1}


def _hybrid_layers(head_count_kv: Any, layers: int, path: Path, other: str = "mamba") -> tuple[list[int], int]:
    """(attention layers, their KV heads) from the per-layer head_count_kv, 0 in the
    ``other`` layers (a mixer, a short convolution)."""
    counts = [int(n) for n in head_count_kv] if isinstance(head_count_kv, list) else [int(head_count_kv)] * layers
    attention = [i for i, n in enumerate(counts) if n]
    wrong = ("the wrong length" if len(counts) != layers else "no attention layer" if not attention
             else f"no {other} layer" if len(attention) == layers else None)
    if wrong:
        raise ModelLoadError(f"GGUF {path}: a hybrid needs attention.head_count_kv per layer "
                             f"({layers} of them), nonzero in the attention layers and 0 in the {other} layers, "
                             f"at least one of each; the file's {counts} has {wrong}")
    kv_heads = {counts[i] for i in attention}
    if len(kv_heads) > 1:
        raise ModelLoadError(f"GGUF {path}: the attention layers' head_count_kv differ "
                             f"({counts}); a hybrid has one num_key_value_heads")
    return attention, kv_heads.pop()


def _rope_scaling(reader: Any, arch: str, config: dict[str, Any], path: Path
                  ) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if kind == "yarn" and value is not None:
                scaling[key] = float(value)
        log_multiplier = _field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
        if kind == "yarn" and arch == "deepseek2" and log_multiplier:
            # deepseek2 files store 0.1 * mscale_all_dim (llama.cpp's legacy convention).
            scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_multiplier) * 10, 6)
        if kind == "yarn" and arch == "gpt-oss":  # its config's YaRN: the blend's bounds not rounded outwards
            scaling = {"beta_fast": 32.0, "beta_slow": 1.0, **scaling, "truncate": False}
        return scaling
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        return _llama3_scaling(dequantize(rope_freqs), config, path)
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if arch == "phi3" and factors:
        return _longrope_scaling(reader, factors, config, path)
    return None


def _longrope_scaling(reader: Any, factors: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: the short and long factors
    as tensors, the original context and the attention factor as metadata."""
    if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ModelLoadError(f"GGUF file {path}: LongRoPE needs rope_factors_long and rope_factors_short, got "
                             f"{sorted(factors)}")
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF file {path} lacks required metadata (phi3.rope.scaling.original_context_length)")
    scaling: dict[str, Any] = {
        "rope_type": "longrope", "original_max_position_embeddings": int(original),
        "long_factor": [float(v) for v in dequantize(factors["rope_factors_long.weight"]).reshape(-1)],
        "short_factor": [float(v) for v in dequantize(factors["rope_factors_short.weight"]).reshape(-1)]}
    attention = _field(reader, "phi3.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _llama3_scaling(freq_factors: np.ndarray, config: dict[str, Any], path: Path
                    ) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1-style rope scaling as per-dimension divisors of the
    rotary frequencies, not as parameters. Recover the parameters by matching the
    published settings (Llama 3.1: factor 8; Llama 3.2: factor 32)."""
    dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for factor in (8.0, 32.0, 16.0, 4.0):
        candidate = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        scaled = _llama3_inv_freq(inv_freq, candidate)
        if np.allclose(inv_freq / scaled, freq_factors, rtol=1e-3):
            return candidate
    raise ModelLoadError(f"GGUF file {path} has rope_freqs that match no known "
                         "llama3 rope scaling")


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth == 1: high frequency, unchanged; smooth == 0: low frequency, / factor.
    scaled: np.ndarray = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (an array as a list: granitehybrid's per-layer head_count_kv); a
    float32 comes back as the shortest decimal that is that float32 (1e-06, not
    9.99999997e-07): the HF value the converter rounded."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    value = value.item() if hasattr(value, "item") else value
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32 and isinstance(value, float):
        return float(str(np.float32(value)))
    return value


def dequantize(tensor: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 in torch's (outermost-first) shape."""
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor {tensor.name} uses quantization "
                             f"{tensor.tensor_type.name}, which gguf cannot dequantize") from None
    array = array.astype(np.float32, copy=False).reshape(shape)
    # F32 tensors come back as views of the read-only memory map; torch needs a
    # writable buffer, and callers must not keep the file mapped through them.
    return array if array.flags.writeable else array.copy()
