"""GGUF checkpoints: metadata -> HF config, tensors -> dequantized HF parameters.

Every tensor is dequantized to float32 with ``gguf.quants``; the engine never runs
quantized kernels. ``general.architecture`` names the family, its ``<arch>.*`` keys
the shape: llama / mistral (Mixtral where the file has experts), qwen2, qwen2moe, qwen3, qwen3moe,
deepseek2 (DeepSeek-V3 where the router is sigmoid-gated, else V2), mamba2,
granitehybrid (Bamba, and IBM Granite 4.0's hybrids under the same architecture name), nemotron_h and
nemotron_h_moe (Nemotron 3), lfm2, lfm2moe and gpt-oss (its MXFP4 experts dequantized as every other
quantization; gate and up joined back into transformers' fused tensor).

Each tensor comes back under the name the HF checkpoint has, with llama.cpp's
converter (convert_hf_to_gguf.py) undone exactly:

- Llama-family attention (llama, mistral, Mixtral, Bamba's attention layers): llama.cpp
  reorders the rows of Q and K (its rotary kernel pairs adjacent dimensions, HF the two
  halves of each head; over whole heads, Bamba's partial rotary included);
  ``weights.halves_from_pairs`` restores HF's order. Qwen2, Qwen2-MoE and DeepSeek are stored
  unpermuted (DeepSeek's own rotary pairs are adjacent already).
- Experts: one 3D tensor per projection, ``ffn_{gate,up,down}_exps`` [experts, out, in],
  split into the hub's per-expert tensors (files from before April 2024 hold
  ``ffn_gate.E`` per expert: the same names).
- DeepSeek: newer files store ``kv_b_proj`` per head as ``attn_k_b`` (transposed,
  [heads, kv_lora_rank, nope]) and ``attn_v_b`` ([heads, v, kv_lora_rank]) for
  llama.cpp's absorbed attention, with head_count_kv 1 and key_length kv_lora_rank +
  rope (one latent "head"); the per-head sizes are then ``key_length_mla`` /
  ``value_length_mla``. The two are joined back into ``kv_b_proj``; older files hold
  ``attn_kv_b`` whole and the per-head sizes in key_length / value_length.
- Mamba2: A is stored as -exp(A_log) (taken back to the float32 A_log whose exp is
  that A exactly, where one is), A and D as [heads, 1], the gated norm as [groups,
  d_inner / groups], conv1d as [channels, kernel] and dt_bias as ``ssm_dt.bias``. Its
  context_length (2**20) is the converter's placeholder and is dropped.
- Bamba: its mixers (HF ``mamba.``) are stored as Mamba2's, its attention layers and
  MLPs under the Llama names (``pre_ff_layernorm`` as ``ffn_norm``), its final norm as
  ``output_norm``. Granite 4.0 the same, its fused shared MLP split into gate and up
  (``ffn_{gate,up,down}_shexp`` beside experts, ``ffn_{gate,up,down}`` without), its
  fused experts into ``ffn_{gate,up,down}_exps``.
- Nemotron-H (llama.cpp's NemotronHModel on GraniteHybridModel): its blocks' norms as
  ``attn_norm``, its mixers as Mamba2's, its attention's q/k rows permuted (undone), its
  MLPs as ``ffn_up`` / ``ffn_down``; the block kinds from the per-block head_count_kv and
  feed_forward_length (gguf_config.py).

The config each file implies is built in ``gguf_config.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloom.models.errors import ModelLoadError
from kvloom.models.gguf_config import GGUF_ARCHITECTURES, dequantize, gguf_architecture, gguf_hf_config
from kvloom.models.weights import halves_from_pairs
from kvloom.tokenizer import Tokenizer

__all__ = ["GGUF_ARCHITECTURES", "dequantize", "gguf_architecture", "gguf_hf_config", "gguf_tokenizer", "gguf_weights",
           "num_weights", "open_gguf", "permute_rows"]

# (Granite 4.0's too: its converter permutes them though the model turns no rotary.)
_PERMUTED_QK = {"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "BambaForCausalLM",
                "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
                "GraniteForCausalLM", "GraniteMoeForCausalLM", "SmolLM3ForCausalLM", "OlmoForCausalLM",
                "ArceeForCausalLM"}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # a LayerNorm's (StarCoder2)
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",  # Phi's output head has one
}
# Families whose top-level names are not _TOP_LEVEL_NAMES.
_FAMILY_TOP_LEVEL_NAMES = {
    "Mamba2ForCausalLM": {
        "token_embd.weight": "backbone.embeddings.weight",
        "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight",
    },
    "BambaForCausalLM": {**_TOP_LEVEL_NAMES, "output_norm.weight": "model.final_layernorm.weight"},
    # LFM2's final norm is its embedding_norm, stored as token_embd_norm.
    "Lfm2ForCausalLM": {**_TOP_LEVEL_NAMES, "token_embd_norm.weight": "model.embedding_norm.weight"},
    "Lfm2MoeForCausalLM": {**_TOP_LEVEL_NAMES, "token_embd_norm.weight": "model.embedding_norm.weight"},
    "GPT2LMHeadModel": {**_TOP_LEVEL_NAMES, "position_embd.weight": "model.wpe.weight"},
    "NemotronHForCausalLM": {"token_embd.weight": "backbone.embeddings.weight",
                             "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"},
}
# Families whose layers are HF's ``backbone.layers.N`` (the rest: ``model.layers.N``).
_BACKBONE_FAMILIES = {"Mamba2ForCausalLM", "NemotronHForCausalLM"}
# GGUF block part -> HF module inside the layer (".weight" / ".bias" appended), or
# "part.kind" -> the HF leaf name itself; "{}" in an expert name is the expert's index.
_ATTENTION_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _experts(prefix: str, gate: str, up: str, down: str) -> dict[str, str]:
    return {"ffn_gate_exps": f"{prefix}.{{}}.{gate}", "ffn_up_exps": f"{prefix}.{{}}.{up}",
            "ffn_down_exps": f"{prefix}.{{}}.{down}"}


def _mixer(prefix: str) -> dict[str, str]:
    """Mamba2's mixer, HF module ``prefix`` (Mamba2's ``mixer``, Bamba's ``mamba``)."""
    return {"ssm_in": f"{prefix}.in_proj", "ssm_conv1d": f"{prefix}.conv1d", "ssm_dt.bias": f"{prefix}.dt_bias",
            "ssm_a": f"{prefix}.A_log", "ssm_d": f"{prefix}.D", "ssm_norm": f"{prefix}.norm",
            "ssm_out": f"{prefix}.out_proj"}


def _shared(prefix: str) -> dict[str, str]:
    return {"ffn_gate_shexp": f"{prefix}.gate_proj", "ffn_up_shexp": f"{prefix}.up_proj",
            "ffn_down_shexp": f"{prefix}.down_proj"}


_QWEN3_BLOCK = {**_ATTENTION_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "LlamaForCausalLM": _ATTENTION_BLOCK, "MistralForCausalLM": _ATTENTION_BLOCK, "Qwen2ForCausalLM": _ATTENTION_BLOCK,
    "Qwen3ForCausalLM": _QWEN3_BLOCK,
    "Qwen3MoeForCausalLM": {**_QWEN3_BLOCK, "ffn_gate_inp": "mlp.gate",
                            **_experts("mlp.experts", "gate_proj", "up_proj", "down_proj")},
    "MixtralForCausalLM": {**_ATTENTION_BLOCK, "ffn_gate_inp": "block_sparse_moe.gate",
                           **_experts("block_sparse_moe.experts", "w1", "w3", "w2")},
    "Qwen2MoeForCausalLM": {**_ATTENTION_BLOCK, "ffn_gate_inp": "mlp.gate",
                            "ffn_gate_inp_shexp": "mlp.shared_expert_gate", **_shared("mlp.shared_expert"),
                            **_experts("mlp.experts", "gate_proj", "up_proj", "down_proj")},
    "DeepseekV2ForCausalLM": {
        **_ATTENTION_BLOCK, "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "ffn_gate_inp": "mlp.gate",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        **_experts("mlp.experts", "gate_proj", "up_proj", "down_proj"), **_shared("mlp.shared_experts")},
    "Mamba2ForCausalLM": {"attn_norm": "norm", **_mixer("mixer")},
    "BambaForCausalLM": {
        **_ATTENTION_BLOCK, "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
        "ffn_down": "feed_forward.down_proj", "ffn_norm": "pre_ff_layernorm", **_mixer("mamba")},
}
_BLOCK_NAMES["DeepseekV3ForCausalLM"] = _BLOCK_NAMES["DeepseekV2ForCausalLM"]
# LFM2: its own names for the norms, the attention's output and q/k norms, the MLP (w1 / w3 / w2)
# and the short convolutions (the conv's weight squeezed to [channels, kernel]: ``_undo``).
_BLOCK_NAMES["Lfm2ForCausalLM"] = {
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj"}
# LFM2-MoE: LFM2's, and in its sparse layers a router, the selection bias (a parameter of its own) and
# each expert's w1 / w3 / w2 (the hub's per-expert names).
_BLOCK_NAMES["Lfm2MoeForCausalLM"] = {
    **_BLOCK_NAMES["Lfm2ForCausalLM"], "ffn_gate_inp": "feed_forward.gate",
    "exp_probs_b.bias": "feed_forward.expert_bias", **_experts("feed_forward.experts", "w1", "w3", "w2")}
# Granite 4.0: Bamba's, its second norm under the hub's name, and its experts (Mixtral's per-expert
# names, inside block_sparse_moe) beside a shared MLP; without experts the shared MLP is ffn_gate/up/down.
_BLOCK_NAMES["GraniteMoeHybridForCausalLM"] = {
    **_BLOCK_NAMES["BambaForCausalLM"], "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.router.layer", **_experts("block_sparse_moe.experts", "w1", "w3", "w2"),
    **_shared("block_sparse_moe.shared_expert")}
# Nemotron-H: every block's norm is attn_norm and its single mixer ``mixer``: Mamba2's, Llama's
# attention (q/k rows permuted by the converter, as GraniteHybridModel's), or the MLP's up / down;
# Nemotron 3's MoE blocks (nemotron_h_moe): the router, its selection bias, every expert's up and down
# (no gate) and the shared expert's.
_BLOCK_NAMES["NemotronHForCausalLM"] = {
    "attn_norm": "norm", **_mixer("mixer"), "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps": "mixer.experts.{}.up_proj", "ffn_down_exps": "mixer.experts.{}.down_proj",
    "ffn_up_shexp": "mixer.shared_experts.up_proj", "ffn_down_shexp": "mixer.shared_experts.down_proj"}
_BLOCK_NAMES["GraniteForCausalLM"] = _BLOCK_NAMES["SmolLM3ForCausalLM"] = _ATTENTION_BLOCK
_BLOCK_NAMES["Ernie4_5ForCausalLM"] = _ATTENTION_BLOCK  # its q/k rows as HF's (adjacent rotary pairs, not permuted)
_BLOCK_NAMES["OlmoForCausalLM"] = _ATTENTION_BLOCK  # (OLMo 1's norms have no tensors)
# GraniteMoe's experts as Mixtral's per-expert names (kvloom's MoE reads either).
_BLOCK_NAMES["GraniteMoeForCausalLM"] = {**_ATTENTION_BLOCK, "ffn_gate_inp": "block_sparse_moe.router.layer",
                                         **_experts("block_sparse_moe.experts", "w1", "w3", "w2")}
# Gemma's: Llama's names. Gemma 2 and 3 norm each block's output: post_attention_norm is
# their post-attention norm, ffn_norm the pre-feedforward one (Llama's post-attention).
_BLOCK_NAMES["GemmaForCausalLM"] = _ATTENTION_BLOCK
_BLOCK_NAMES["Gemma2ForCausalLM"] = {**_ATTENTION_BLOCK, "post_attention_norm": "post_attention_layernorm",
                                     "ffn_norm": "pre_feedforward_layernorm",
                                     "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK_NAMES["Gemma3ForCausalLM"] = {**_BLOCK_NAMES["Gemma2ForCausalLM"], "attn_q_norm": "self_attn.q_norm",
                                     "attn_k_norm": "self_attn.k_norm"}
# OLMo 2 and 3: no input norm; each block's output normed; q and k normed whole.
_BLOCK_NAMES["Olmo2ForCausalLM"] = {key: value for key, value in _ATTENTION_BLOCK.items()
                                    if key not in ("attn_norm", "ffn_norm")} | {
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_NAMES["Olmo3ForCausalLM"] = _BLOCK_NAMES["Exaone4ForCausalLM"] = _BLOCK_NAMES["Olmo2ForCausalLM"]
# StarCoder2's plain MLP: ffn_up is c_fc, ffn_down c_proj (LayerNorm biases as .bias).
_BLOCK_NAMES["Starcoder2ForCausalLM"] = {**_ATTENTION_BLOCK, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Phi's: fc1 / fc2 as ffn_up / ffn_down, dense as attn_output; q, k and v fused in older
# files (attn_qkv: q's rows, then k's, then v's). Its attention and MLP share attn_norm.
_BLOCK_NAMES["PhiForCausalLM"] = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                                  "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                                  "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.dense",
                                  "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# GPT-NeoX's (Pythia's): HF's names, its q/k/v back in HF's per-head order (``_undo``).
_BLOCK_NAMES["GPTNeoXForCausalLM"] = {"attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value",
                                      "attn_output": "attention.dense", "ffn_norm": "post_attention_layernorm",
                                      "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
# GPT-2's: HF's module names (its matmuls stored as Linear's [out, in]: back to Conv1D's in ``_undo``).
_BLOCK_NAMES["GPT2LMHeadModel"] = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                                   "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# StableLM's: Llama's names; its per-head q/k norms stacked [heads, head_dim], read as the
# one weight kvloom's PerHeadLayerNorm holds (``_undo`` flattens them).
_BLOCK_NAMES["StableLmForCausalLM"] = {**_ATTENTION_BLOCK, "attn_q_norm": "self_attn.q_norm",
                                       "attn_k_norm": "self_attn.k_norm"}
# llama.cpp stores Gemma's norm weights as 1 + weight (what its norm multiplies by); HF's
# are the offset. Undone exactly: 1 + w lies in [0.5, 2] for any trained norm, where the
# float32 subtraction of 1 is exact, so 1 + (stored - 1) is the stored number again.
# Families whose norm weights llama.cpp stores plus one (Gemma's scale by 1 + weight, Nemotron's
# LayerNorm1P): the checkpoint's weight is the stored one minus one (a bias is stored as it is).
_NORMS_PLUS_ONE = frozenset({"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "NemotronForCausalLM"})
# Phi-3's fused tensors are kept fused, as HF holds them (q, k, v rows; gate, then up).
_BLOCK_NAMES["Phi3ForCausalLM"] = {**_ATTENTION_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Nemotron's and Arcee's un-gated MLPs: ffn_up / ffn_down as up / down.
_BLOCK_NAMES["NemotronForCausalLM"] = _BLOCK_NAMES["ArceeForCausalLM"] = _ATTENTION_BLOCK
# Falcon's: q/k/v fused (the converter's [q | k | v], put back in HF's KV groups), the first norm
# input_layernorm and Falcon-40B's second ln_mlp, the MLP as GPT-NeoX's.
_BLOCK_NAMES["FalconForCausalLM"] = {"attn_norm": "input_layernorm", "attn_norm_2": "ln_mlp",
                                     "attn_qkv": "self_attention.query_key_value",
                                     "attn_output": "self_attention.dense",
                                     "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
# GPT-OSS's: a router with a bias, attention sinks (HF's leaf has no ".weight"), the experts
# joined back into transformers' fused tensors (``_Converter._join_gpt_oss_experts``).
_BLOCK_NAMES["GptOssForCausalLM"] = {**_ATTENTION_BLOCK, "post_attention_norm": "post_attention_layernorm",
                                     "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp": "mlp.router"}
# blk.<layer>.<part>[.<expert> (old per-expert files)][.weight | .bias (absent for ssm_a, ssm_d)];
# LFM2's parts are dotted (shortconv.conv, ...).
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(shortconv\.(?:conv|in_proj|out_proj)|[a-z0-9_]+?)(?:\.(\d+))?"
                           r"(?:\.(weight|bias))?")
# Consumed into the config (llama3's and Phi-3's rope scaling), not a parameter.
_METADATA_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def open_gguf(path: Path) -> Any:
    """Parse a GGUF file's header (tensor data stays memory-mapped)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/memmap errors, ...
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {exc}") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: tensor "
                                 f"{tensor.name} is cut short")
    return reader


def gguf_weights(reader: Any, arch: str, hf_config: dict[str, Any]
                 ) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """A re-iterable source of (HF name, float32 tensor), dequantized one GGUF tensor at
    a time (an expert tensor yields one tensor per expert)."""
    whole_kv_b = any(t.name.endswith(".attn_kv_b.weight") for t in reader.tensors)

    def iterate() -> Iterator[tuple[str, torch.Tensor]]:
        converter = _Converter(hf_config, whole_kv_b)
        for tensor in reader.tensors:
            if tensor.name in _METADATA_TENSORS:
                continue
            for name, array in converter.convert(tensor.name, dequantize(tensor)):
                yield name, torch.from_numpy(np.ascontiguousarray(array))
        if converter.pending:
            raise ModelLoadError(f"GGUF tensors {sorted(converter.pending)} lack their partner (attn_k_b / attn_v_b, "
                                 "ffn_gate_exps / ffn_up_exps)")

    return iterate


@dataclass
class _Converter:
    """One pass over a file's tensors: GGUF name and array -> HF names and arrays."""

    hf_config: dict[str, Any]
    whole_kv_b: bool  # the file holds attn_kv_b itself: any k_b / v_b are llama.cpp's copies
    # a layer's k_b or v_b awaiting the other (DeepSeek), its gate or up experts (GPT-OSS)
    pending: dict[str, np.ndarray] = field(default_factory=dict)

    def convert(self, gguf_name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        family = self.hf_config["architectures"][0]
        top = _FAMILY_TOP_LEVEL_NAMES.get(family, _TOP_LEVEL_NAMES).get(gguf_name)
        if top is not None:
            yield top, array - 1 if family in _NORMS_PLUS_ONE and gguf_name == "output_norm.weight" else array
            return
        match = _BLOCK_TENSOR.fullmatch(gguf_name)
        if match is None:
            raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")
        layer, part, expert, kind = match.groups()
        prefix = f"{'backbone' if family in _BACKBONE_FAMILIES else 'model'}.layers.{layer}."
        if expert is not None:  # an old Mixtral file's ffn_gate.E: one expert of ffn_gate_exps
            part, array = f"{part}_exps", array[None]
        if part in ("attn_k_b", "attn_v_b") and family.startswith("Deepseek"):
            yield from self._join_kv_b(prefix, part, array)
            return
        if part.endswith("_exps") and family == "GptOssForCausalLM":
            yield from self._join_gpt_oss_experts(prefix, part, kind or "weight", array)
            return
        names = _BLOCK_NAMES[family]
        leaf = names.get(f"{part}.{kind}") if kind else names.get(part)
        if leaf is None and kind and part in names:
            leaf = f"{names[part]}.{kind}"
        if leaf is None:
            raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r} for {family}")
        if part.endswith("_exps"):  # [experts, out, in]
            first = int(expert or 0)
            for index, one in enumerate(array):
                yield prefix + leaf.format(first + index), one
            return
        yield prefix + leaf, self._undo(family, part, kind, array)

    def _undo(self, family: str, part: str, kind: str | None, array: np.ndarray) -> np.ndarray:
        if family in _NORMS_PLUS_ONE and part.endswith("_norm") and kind != "bias":
            return array - 1
        if family in _PERMUTED_QK and part in ("attn_q", "attn_k"):
            heads = self.hf_config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
            return halves_from_pairs(array, heads)
        if family == "GPTNeoXForCausalLM" and part == "attn_qkv":  # llama.cpp's [q | k | v] -> HF's [head][q | k | v]
            heads = self.hf_config["num_attention_heads"]
            per_head: np.ndarray = array.reshape(3, heads, -1, *array.shape[1:]).swapaxes(0, 1).reshape(array.shape)
            return per_head
        if family == "FalconForCausalLM" and part == "attn_qkv":  # [q | k | v] -> HF's groups (q heads, k, v)
            heads, kv_heads = self.hf_config["num_attention_heads"], self.hf_config["num_kv_heads"]
            head_dim = array.shape[0] // (heads + 2 * kv_heads)
            rest = array.shape[1:]
            q, k, v = np.split(array, [heads * head_dim, (heads + kv_heads) * head_dim])
            groups = np.concatenate([q.reshape(kv_heads, heads // kv_heads, head_dim, *rest),
                                     k.reshape(kv_heads, 1, head_dim, *rest),
                                     v.reshape(kv_heads, 1, head_dim, *rest)], 1)
            return groups.reshape(array.shape)
        if family == "StableLmForCausalLM" and part in ("attn_q_norm", "attn_k_norm"):  # [heads, head_dim]
            return array.reshape(-1)
        if family == "GPT2LMHeadModel" and kind == "weight" and array.ndim == 2:  # Conv1D's [in, out]
            return np.ascontiguousarray(array.T)
        if part == "ssm_a":  # stored -exp(A_log), [heads, 1]
            return _a_log(array.reshape(-1))
        if part in ("ssm_d", "ssm_norm"):  # [heads, 1] / [groups, d_inner / groups]
            return array.reshape(-1)
        if part in ("ssm_conv1d", "shortconv.conv") and kind == "weight":  # squeezed [channels, kernel]
            return array.reshape(array.shape[0], 1, -1)
        if part == "ffn_gate_inp_shexp":  # HF's Linear(hidden, 1), stored [hidden] or [1, hidden]
            return array.reshape(1, -1)
        return array

    def _join_kv_b(self, prefix: str, part: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """kv_b_proj [heads * (nope + v), rank] from k_b [heads, rank, nope] (llama.cpp
        transposed it) and v_b [heads, v, rank]."""
        if self.whole_kv_b:
            return
        other = prefix + ("attn_v_b" if part == "attn_k_b" else "attn_k_b")
        partner = self.pending.pop(other, None)
        if partner is None:
            self.pending[prefix + part] = array
            return
        k_b, v_b = (array, partner) if part == "attn_k_b" else (partner, array)
        heads, rank = self.hf_config["num_attention_heads"], self.hf_config["kv_lora_rank"]
        nope, v_dim = self.hf_config["qk_nope_head_dim"], self.hf_config["v_head_dim"]
        if k_b.size != heads * rank * nope or v_b.size != heads * v_dim * rank:
            raise ModelLoadError(f"GGUF tensors {prefix}attn_k_b / attn_v_b have {k_b.size} / {v_b.size} numbers; "
                                 f"{heads} heads of kv_lora_rank {rank}, nope {nope}, v {v_dim} need "
                                 f"{heads * rank * nope} / {heads * v_dim * rank}")
        # [heads, rank, nope] -> [heads, nope, rank]; with v_b: [heads, nope + v, rank]
        joined = np.concatenate((k_b.reshape(heads, rank, nope).transpose(0, 2, 1), v_b.reshape(heads, v_dim, rank)), 1)
        yield prefix + "self_attn.kv_b_proj.weight", joined.reshape(heads * (nope + v_dim), rank)


    def _join_gpt_oss_experts(self, prefix: str, part: str, kind: str, array: np.ndarray
                              ) -> Iterator[tuple[str, np.ndarray]]:
        """GPT-OSS's experts as transformers holds them, from llama.cpp's ``ffn_*_exps``
        ([experts, out, in]; biases [experts, out]): gate and up (each awaiting the other)
        back into gate_up [experts, hidden, 2 x inter], their outputs alternating, and
        its bias [experts, 2 x inter] alike; down turned to [experts, inter, hidden]."""
        suffix = "" if kind == "weight" else "_bias"
        if part == "ffn_down_exps":
            yield prefix + f"mlp.experts.down_proj{suffix}", array if kind == "bias" else array.transpose(0, 2, 1)
            return
        if part not in ("ffn_gate_exps", "ffn_up_exps"):
            raise ModelLoadError(f"unsupported GGUF tensor {prefix}{part}.{kind} for GPT-OSS")
        other = prefix + ("ffn_up_exps" if part == "ffn_gate_exps" else "ffn_gate_exps") + "." + kind
        partner = self.pending.pop(other, None)
        if partner is None:
            self.pending[f"{prefix}{part}.{kind}"] = array
            return
        gate, up = (array, partner) if part == "ffn_gate_exps" else (partner, array)
        if gate.shape != up.shape:
            raise ModelLoadError(f"GGUF tensors {prefix}ffn_gate_exps / ffn_up_exps .{kind} differ in shape: "
                                 f"{gate.shape} and {up.shape}")
        joined = np.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), dtype=gate.dtype)
        joined[:, 0::2], joined[:, 1::2] = gate, up
        yield prefix + f"mlp.experts.gate_up_proj{suffix}", joined if kind == "bias" else joined.transpose(0, 2, 1)


def _a_log(a: np.ndarray) -> np.ndarray:
    """A_log from llama.cpp's A = -exp(A_log): of the float32 numbers next to log(-A),
    the one whose float32 exp (torch's, as the mixer takes it) is -A exactly where one
    is, so the model's A is the stored A bit for bit."""
    target = torch.from_numpy(-a.astype(np.float32))
    best = torch.from_numpy(np.log(-a.astype(np.float64))).float()
    for neighbour in (best.nextafter(torch.tensor(math.inf)), best.nextafter(torch.tensor(-math.inf))):
        best = torch.where((torch.exp(best) != target) & (torch.exp(neighbour) == target), neighbour, best)
    result: np.ndarray = best.numpy()
    return result


def num_weights(reader: Any) -> int:
    """How many tensors ``gguf_weights`` yields."""
    whole_kv_b = any(t.name.endswith(".attn_kv_b.weight") for t in reader.tensors)
    architecture = reader.fields.get("general.architecture")
    fused_experts = architecture is not None and architecture.contents() == "gpt-oss"  # gate and up become one
    count = 0
    for tensor in reader.tensors:
        name = tensor.name
        if name in _METADATA_TENSORS or ".attn_v_b." in name or (".attn_k_b." in name and whole_kv_b):
            continue
        if fused_experts and "_exps." in name:
            count += 0 if ".ffn_up_exps." in name else 1
            continue
        count += int(tensor.shape[-1]) if "_exps." in name else 1  # innermost first: experts last
    return count


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of ``weights.halves_from_pairs``); for tests that
    write GGUF files the way llama.cpp's converter does."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [num_heads, 2, half, in] -> [num_heads, half, 2, in] -> the weight's shape
    permuted: np.ndarray = weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)
    return permuted


def gguf_tokenizer(reader: Any, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(reader)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build the tokenizer of {path}: {exc}") from None


