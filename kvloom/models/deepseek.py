"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a latent pool, and a
mixture-of-experts FFN after the first ``first_k_dense_replace`` dense layers.

MLA in one paragraph: every token's K (its non-rotary part, per head) and V (per
head) are up-projections of one latent ``c_kv`` (``kv_lora_rank`` wide, RMS-normed);
the rotary part of K, ``k_pe``, is one vector shared by all heads. The pool stores
``[c_kv | k_pe]`` per token and layer (``ModelConfig.kv_entry`` (1, 1, latent)): for
DeepSeek-V2's 512 + 64 that is 576 numbers where per-head K and V would be 128 heads x
(192 + 128). Attention is computed in the absorbed form, as vLLM and SGLang decode it:
each head's query is mapped into latent space through its K up-projection (``q_nope @
W_uk``), attends over the latents (attention/mla_cpu.py, mla_ref.py), and the result is
mapped out through its V up-projection (``W_uv``) before ``o_proj``. So the latent is never
expanded per head. The up-projections run per head at each step (one grouped GEMM call
each, heads as the groups), not folded into q_proj and o_proj at load: folded, those two
would be ``rank + rope`` and ``rank`` wide per head instead of ``nope + rope`` and ``v``,
2.7x the bytes a decode step reads for DeepSeek-V2-Lite's attention and more arithmetic
as well (the twenty-second session folded them; the thirty-sixth unfolded them).

Numerics follow transformers' DeepseekV2/V3 (norms in float32; the rotary part of q
and k rotated in float32). The rotary dimensions are interleaved pairs (x0, x1), (x2,
x3), ... (V2 always, V3 with ``rope_interleave``); the rotated vector is written
de-interleaved (evens' results, then odds'), as transformers' V3 does. q and k get the
same permutation, so their dot product, all attention uses, is unchanged.

Under tensor parallel each rank holds its share of the heads: their rows of the query
projection and of ``kv_b_proj``, their columns of ``o_proj`` (whose partial sums are
all-reduced), and the MLPs' and experts' features as the Llama family's; the latent
projection and its norms are every rank's (each rank's pool holds the same latents, the one
KV "head" every query head reads).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.kernels import gemm, latent_attention
from kvloom.model_families import MLAConfig
from kvloom.models.decoder_stack import NativeDecoderStack
from kvloom.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvloom.models.moe import SparseMoE
from kvloom.models.packed_linear import can_pack_invariant, pack_with_tied_head
from kvloom.models.sharding import TensorSlice, column_split, llama_weight_slice
from kvloom.models.weights import WeightFiller


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` [tokens, heads, dim] in float32, at the tokens' angles
    (``cos``/``sin``: [tokens, dim], ``cat(freqs, freqs)`` as RotaryEmbedding gives).
    ``interleaved``: pairs are adjacent elements; the output is de-interleaved. On a CPU
    one native call (``kvloom::latent_rotary``: these ops' bits, ~9 calls fewer a use)."""
    if x.is_cpu and x.dtype in latent_attention.ACTIVATIONS and latent_attention.available():
        return latent_attention.latent_rotary(x.contiguous(), cos.contiguous(), sin.contiguous(), interleaved)
    return rotate_reference(x, cos, sin, interleaved)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``rotate`` in PyTorch ops (transformers' own; the oracle of the native call)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    xf = x.float()
    first, second = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


@dataclass(frozen=True)
class HeadProjections:
    """A layer's per-head up-projections packed for ``gemm_grouped_bf16``, row h head h's:
    ``keys`` each head's W_uk^T [rank, nope] (its query into latent space), ``values`` its
    W_uv [v, rank] (its attention output out of it)."""

    keys: torch.Tensor
    values: torch.Tensor
    rank: int
    value_dim: int
    isa: str

    def into_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        return self._per_head(q_nope, self.keys, self.rank)

    def out_of_latent(self, out: torch.Tensor) -> torch.Tensor:
        return self._per_head(out, self.values, self.value_dim)

    def _per_head(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [tokens, heads, in] through each head's packed weight: one grouped GEMM call,
        the heads as the groups (each row's bits a plain GEMM's with its head's weight)."""
        tokens, heads, width = x.shape
        rows = x.transpose(0, 1).reshape(heads * tokens, width).contiguous()  # head after head
        starts = torch.arange(0, (heads + 1) * tokens, tokens)
        y = gemm.gemm_grouped_bf16(rows, packed, starts, out_features, self.isa)
        return y.view(heads, tokens, out_features).transpose(0, 1)


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, mla: MLAConfig, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads // tp.size  # this rank's heads
        self.mla = mla
        self.tp = tp
        self.num_heads = heads
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj: nn.Module | None = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        # kv_b_proj's weight, viewed per head: [heads, nope + v, kv_lora_rank]. Kept as a
        # plain parameter (not a Linear that packing would replace): each head's halves map
        # its query into latent space and its output out of it (_into_latent, _out_of_latent).
        self.kv_b = nn.Parameter(torch.zeros(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)

        # Set by pack_heads(): each head's W_uk and W_uv packed for the grouped GEMM.
        self.grouped: HeadProjections | None = None

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv_cache: torch.Tensor, backend: AttentionBackend[Any], metadata: Any) -> torch.Tensor:
        mla, tokens, heads = self.mla, hidden.shape[0], self.num_heads
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_pe = rotate(k_pe.unsqueeze(1), *rotary, mla.rope_interleave)  # [tokens, 1, rope]
        # c_kv made contiguous: the fused norm (the native walk's) rather than its reference on a view
        latent = torch.cat((self.kv_a_layernorm(c_kv.contiguous()).unsqueeze(1), k_pe), dim=-1)  # [tokens, 1, latent]
        q_in = hidden if mla.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_proj(q_in) if self.q_proj is not None else self.q_b_proj(q_in)
        q_nope, q_pe = q.view(tokens, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim],
                                                                    dim=-1)
        query = torch.cat((self._into_latent(q_nope), rotate(q_pe, *rotary, mla.rope_interleave)), dim=-1)
        out = backend.forward(query, latent, None, kv_cache, batch, metadata)  # [tokens, heads, rank]
        values = self._out_of_latent(out)  # [tokens, heads, v_head_dim]
        projected: torch.Tensor = self.o_proj(values.reshape(tokens, heads * mla.v_head_dim))
        return self.tp.all_reduce(projected)

    def _into_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, nope] -> [tokens, heads, rank]: each head's query through its W_uk."""
        if self.grouped is None:
            return torch.einsum("thn,hnr->thr", q_nope, self.kv_b[:, :self.mla.qk_nope_head_dim])
        return self.grouped.into_latent(q_nope)

    def _out_of_latent(self, out: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, rank] -> [tokens, heads, v]: each head's output through its W_uv."""
        if self.grouped is None:
            return torch.einsum("thr,hvr->thv", out, self.kv_b[:, self.mla.qk_nope_head_dim:])
        return self.grouped.out_of_latent(out)

    def pack_heads(self, matmul: str) -> int:
        """Each head's W_uk (as [rank, nope]: the query's map into latent space) and W_uv
        ([v, rank]) packed for the grouped GEMM, where ``matmul`` is the batch-invariant
        kernel and it serves the weights (bf16 on a CPU). Returns the weights packed."""
        mla = self.mla
        if matmul != "invariant" or not can_pack_invariant(self.kv_b):
            return 0
        w_uk, w_uv = torch.split(self.kv_b.detach(), [mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        keys, values = gemm.pack_weight_groups([[w.T.contiguous() for w in w_uk], [w.contiguous() for w in w_uv]])
        self.grouped = HeadProjections(keys, values, mla.kv_lora_rank, mla.v_head_dim, gemm.default_isa() or "")
        return 2 * self.num_heads


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mla: MLAConfig, index: int,
                 tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, mla, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.mlp: SparseMoE | GatedMLP = (
            SparseMoE(config.hidden_size, moe, tp) if moe is not None and moe.is_sparse(index)
            else GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp))


class DeepseekForCausalLM(nn.Module):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""

    def __init__(self, config: ModelConfig, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture}: config.json has no latent-attention fields")
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, mla, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling_dict)
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=False))  # this rank's rows
        # The layers walked in one native call (models/decoder_stack.py), once asked for by
        # use_native_stack; the module path below is the reference and the fallback.
        self.native_stack: NativeDecoderStack | None = None

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """The final hidden states [tokens, hidden]; ``kv_caches`` is the latent pool
        [layers, 1, num_blocks, block_size, 1, latent]."""
        residual = self.embed_tokens(batch.input_ids)  # the residual stream, added to in place
        rotary = self.rotary.cos_sin_for(batch)
        stack = self.native_stack
        if stack is not None and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None):
            last, stream = stack(residual, rotary, batch, kv_caches, backend, metadata)
            walked: torch.Tensor = self.norm(last, stream)  # the rows batch.output_rows names, if any
            return walked
        hidden = None
        for index, layer in enumerate(self.decoder_layers):
            normed = (layer.input_layernorm(residual) if hidden is None
                      else layer.input_layernorm(hidden, residual))
            hidden = layer.self_attn(normed, rotary, batch, kv_caches[index], backend, metadata)
            hidden = layer.mlp(layer.post_attention_layernorm(hidden, residual))
        out: torch.Tensor = self.norm(hidden, residual)
        return batch.final_states(out)

    @property
    def decoder_layers(self) -> list[DeepseekDecoderLayer]:
        return cast(list[DeepseekDecoderLayer], list(self.layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab]; under tensor parallel a collective whose full
        result is rank 0's (each rank computes its share of the vocabulary)."""
        local: torch.Tensor = (torch.nn.functional.linear(hidden, self.embed_tokens.weight) if self.lm_head is None
                               else self.lm_head(hidden))
        return self.embed_tokens.gather_logits(local)

    def pack_weights(self, matmul: str = "invariant") -> int:
        """Pack the matmuls as the Llama family does, and each head's up-projections for
        the grouped GEMM; call after ``load_weights`` and the dtype move."""
        heads = sum(layer.self_attn.pack_heads(matmul) for layer in self.decoder_layers)
        return pack_with_tied_head(self, self.embed_tokens.weight, matmul) + heads

    def use_native_stack(self) -> str | None:
        """Walk the layers in one native call from now on where it can (None), else why not."""
        self.native_stack, reason = NativeDecoderStack.build(self)
        return None if self.native_stack is not None else reason

    def first_layers(self, num_layers: int) -> DeepseekForCausalLM:
        raise ValueError(f"layer_skip drafts are not implemented for {self.config.architecture}")

    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        """This rank's part of checkpoint tensor ``hf_name``: its heads' rows of the query
        projection and ``kv_b_proj``, their columns of ``o_proj``; the rest as the Llama
        family's (MLPs, experts, the vocabulary); the latent projection whole."""
        size, mla = self.tp.size, self.config.mla
        if size == 1:
            return None
        assert mla is not None
        heads = column_split(self.config.num_heads, self.tp.rank, size)
        per_head = {".self_attn.q_proj.weight": (0, mla.qk_head_dim),
                    ".self_attn.q_b_proj.weight": (0, mla.qk_head_dim),
                    ".self_attn.kv_b_proj.weight": (0, mla.qk_nope_head_dim + mla.v_head_dim),
                    ".self_attn.o_proj.weight": (1, mla.v_head_dim)}
        for suffix, (dim, width) in per_head.items():
            if hf_name.endswith(suffix):
                return TensorSlice(dim, heads[0] * width, heads[1] * width)
        if ".self_attn." in hf_name:  # the latent's projection and norms, q_a's: every rank's
            return None
        return llama_weight_slice(self.config, hf_name, self.tp.rank, size, self.tp.expert_parallel)

    # ---- loading ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise if a parameter is left unset or a name is
        unknown. Dense FFN gate/up go into the fused ``gate_up_proj``; ``kv_b_proj`` is
        viewed per head; a MoE layer's tensors go to its ``load_hf``."""
        filler = WeightFiller(self)
        mla = self.config.mla
        assert mla is not None
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if name.startswith("layers.") and ".mlp." in name:
                index = int(name.split(".")[1])
                mlp = self.decoder_layers[index].mlp
                if isinstance(mlp, SparseMoE):
                    for target, count in mlp.load_hf(name.split(".mlp.", 1)[1], tensor).items():
                        filler.count(f"layers.{index}.mlp.{target}", count)
                    continue
            target, rows = name, None
            if name.endswith("mlp.gate_proj.weight"):
                target, rows = name.replace("gate_proj", "gate_up_proj"), slice(0, tensor.shape[0])
            elif name.endswith("mlp.up_proj.weight"):
                target, rows = name.replace("up_proj", "gate_up_proj"), slice(tensor.shape[0], 2 * tensor.shape[0])
            elif name.endswith("self_attn.kv_b_proj.weight"):  # this rank's heads
                target = name.replace("kv_b_proj.weight", "kv_b")
                tensor = tensor.view(-1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
            elif target == "embed_tokens.weight" or target == "lm_head.weight":
                rows = slice(0, self.embed_tokens.num_real_rows)  # the vocabulary's padding rows stay zero
            filler.copy(target, tensor, hf_name, rows)
        padding = (self.embed_tokens.weight.shape[0] - self.embed_tokens.num_real_rows) * self.config.hidden_size
        filler.finish_shard(padding, ("embed_tokens.weight", "lm_head.weight"), self.tp.rank)
        filler.check_complete()
