"""Llama-family decoder: Llama (SmolLM2, TinyLlama, Llama-3), Qwen2/2.5, Qwen3, Mistral,
and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE.

The differences are flags on ModelConfig (q/k/v bias, Qwen3's q/k norms, tied
embeddings, rope scaling);
where ``config.moe`` makes a layer sparse, its FFN is models/moe.py's SparseMoE.
Q/K/V and gate/up are fused into single matmuls at load time; ``load_weights``
accepts Hugging Face parameter names and routes each shard into the fused tensors.
Under tensor parallel (``tp``, models/sharding.py) each rank builds its share of the
heads, features and vocabulary, and reads only that part of each checkpoint tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models import ops
from kvloom.models.decoder_stack import NativeDecoderStack
from kvloom.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from kvloom.models.moe import SparseMoE
from kvloom.models.packed_linear import pack_with_tied_head
from kvloom.models.sharding import (
    TensorSlice,
    fused_rows,
    llama_weight_slice,
    moe_block_name,
    tensor_parallel_problem,
)
from kvloom.models.weights import WeightFiller, halves_from_pairs, rename


class LlamaAttention(nn.Module):
    """Under tensor parallel a rank holds ``1 / ranks`` of the query heads and of the KV
    heads (the KV pool of its heads too); the output projection is row-parallel.
    ``window``: the keys each query attends back to (a sliding window, its own key
    included), 0 for the whole context."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, window: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.window = window
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        # Qwen3 and Gemma 3: every query and key head RMS-normed over head_dim before the rotary.
        norm = GemmaRMSNorm if config.gemma is not None else RMSNorm
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.clip = config.clip_qkv  # OLMo 1's
        # GPT-OSS's attention sinks: a logit per query head (this rank's heads) in the softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch, kv_cache: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]; with ``rows``, the output of those rows
        only (every row's K and V still go into the cache). ``rotary`` None: a model whose
        positions are in its embeddings (GPT-2) turns no query or key."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [tokens, q | k | v]
        if self.clip is not None:
            qkv = qkv.clamp_(-self.clip, self.clip)
        if self.q_norm is not None and self.k_norm is not None:
            # Rows of each norm's width: a head (Qwen3, Gemma 3) or the whole projection (OLMo 2).
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            # Contiguous rows: a whole projection's reshape is a strided view of qkv, which the
            # fused norm does not take (the reference would run, rounding its sum otherwise).
            q = self.q_norm(q.reshape(-1, self.q_norm.weight.shape[0]).contiguous()).view(num_tokens, self.q_size)
            k = self.k_norm(k.reshape(-1, self.k_norm.weight.shape[0]).contiguous()).view(num_tokens, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)
        # q's heads and k's are adjacent in a row: one in-place call rotates both.
        if rotary is not None:
            ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rotary)  # Phi-4's: a part of each
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache, batch, metadata, self.window,
                              sinks=self.sinks).reshape(num_tokens, self.q_size)
        if rows is not None:
            out = out[rows]
        return self.tp.all_reduce(self.o_proj(out))  # [tokens or rows, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS, index: int = 0,
                 window: int = 0) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):  # its gated MLP is SwiGLU (SiLU is swish)
            raise ValueError(f"{config.architecture}: hidden_act {config.hidden_act!r} is not supported "
                             "(supported: silu)")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, window)
        self.local_rope = config.uses_local_rope(index)  # a windowed layer with its own rotary
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.mlp: GatedMLP | SparseMoE = (
            SparseMoE(config.hidden_size, moe, tp) if moe is not None and moe.is_sparse(index)
            else GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp))


class LlamaForCausalLM(nn.Module):
    # Also a sequence classifier (``config.classifier``): the head is then the score layer.
    has_score_head = True
    # A family with other layers and norms (models/gemma.py, olmo2.py) names its own, and
    # what keeps them from the native walk (which runs Llama's).
    layer_class: type[nn.Module] = LlamaDecoderLayer
    norm_class: type[RMSNorm] = RMSNorm
    modules_only: str | None = None
    # Checkpoint name fragments that differ from these modules' ((theirs, ours), replaced in
    # order: Phi's ``dense`` is o_proj), as the family's load_weights reads its tensors and
    # kvloom/lora reads an adapter's.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        problem = tensor_parallel_problem(config, tp.size, tp.expert_parallel)
        if problem is not None:
            raise ValueError(problem)
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(config, tp, index, config.attention_window(index, max_positions))
                                    for index in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling_dict)
        # The windowed layers' own rotary, where theirs is not the full layers' (Gemma 3, OLMo 3).
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, max_positions,
                                                config.local_rope_theta, dict(config.local_rope_scaling or ()))
        if config.classifier is not None:  # the checkpoint's `score`, whole on every rank
            self.lm_head = nn.Linear(config.hidden_size, config.classifier.num_labels, bias=config.classifier.bias)
        elif config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        # The layers walked in one native call (models/decoder_stack.py), once asked for
        # by use_native_stack; the module path below is the reference and the fallback.
        self.native_stack: NativeDecoderStack | None = None

    def fused_qkv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A checkpoint's fused q/k/v output rows (its weight's, or a LoRA B's) in kvloom's
        [q | k | v] order, which they are in unless a family says otherwise (GPT-NeoX)."""
        return rows

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """Returns the final hidden states, [tokens, hidden]; kv_caches is the whole pool
        [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        residual = self.embed_tokens(batch.input_ids)  # the residual stream, added to in place
        scales = self.config.scales
        if scales is not None and scales.embedding != 1.0:  # Granite's, in the model's dtype as HF's
            residual = residual * scales.embedding
        full = rotary = self.rotary.cos_sin_for(batch)
        local = self.local_rotary.cos_sin_for(batch) if self.local_rotary is not None else full
        stack = self.native_stack
        if stack is not None and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None):
            hidden, residual = stack(residual, rotary, batch, kv_caches, backend, metadata)
            return self.norm(self._into_residual(hidden), residual)  # the rows batch.output_rows names, if any
        # The last layer's o projection and MLP run on the rows the step reads alone (one
        # process: under tensor parallel every rank would have to agree on them).
        rows = batch.output_rows if self.tp.size == 1 else None
        last = len(self.layers) - 1
        hidden = None  # the previous block's output, not yet added to the stream
        for index, layer in enumerate(self.layers):
            # Each norm first adds the previous block's output into the residual stream
            # (fused; same rounding as HF's `residual + hidden`); layer 0 has none to add.
            normed = (layer.input_layernorm(residual) if hidden is None
                      else layer.input_layernorm(hidden, residual))
            rotary = None if index in self.config.no_rope_layers else local if layer.local_rope else full
            if index == last and rows is not None:
                hidden = layer.self_attn(normed, rotary, batch, kv_caches[index], backend, metadata, rows)
                residual = residual[rows]
            else:
                hidden = layer.self_attn(normed, rotary, batch, kv_caches[index], backend, metadata)
            hidden = layer.mlp(layer.post_attention_layernorm(self._into_residual(hidden), residual))
            hidden = self._into_residual(hidden)
        out: torch.Tensor = self.norm(hidden, residual)
        return out if rows is not None else batch.final_states(out)

    def _into_residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream: Granite's times its
        residual multiplier (in the model's dtype, as HF's), everyone else's as it is."""
        scales = self.config.scales
        return hidden if scales is None or scales.residual == 1.0 else hidden * scales.residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab]; under tensor parallel a collective (every rank
        calls it with the same rows), whose full result is rank 0's. A classifier's rows
        are its class logits, [rows, num_labels], computed whole on every rank."""
        if self.config.classifier is not None:
            assert self.lm_head is not None
            return self.lm_head(hidden)
        if self.lm_head is None:  # tied: the embedding table is the output head
            local = torch.nn.functional.linear(hidden, self.embed_tokens.weight)  # [rows, shard]
        else:
            local = self.lm_head(hidden)
        logits = self.embed_tokens.gather_logits(local)
        scales = self.config.scales
        if scales is None:
            return logits
        if scales.logits != 1.0:
            logits = logits / scales.logits
        return logits if scales.logit_scale == 1.0 else logits * scales.logit_scale

    def pack_weights(self, matmul: str = "invariant") -> int:
        """Pack the matmul weights once for the ``matmul`` kernel (models/packed_linear.py:
        ``invariant``, ``onednn`` or ``torch``); call after ``load_weights``. A tied
        output head gets its own packed copy of the embedding table (vocab x hidden more
        memory: 56 MB for SmolLM2-135M) because the lookup needs the plain one. Returns
        how many layers were packed."""
        return pack_with_tied_head(self, self.embed_tokens.weight, matmul)

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """The self-speculative draft (layer skip): this model's first ``num_layers``
        decoder layers, then its final norm and output head, all shared (no weight is
        copied; call after ``pack_weights``). Its KV pool has ``num_layers`` layers.
        Every module and parameter outside the layers is this model's own (a family's
        too: GPT-2's positions, a tied Phi head's bias)."""
        if self.tp.size > 1:
            raise ValueError("layer_skip drafts cannot run on a tensor-parallel model")
        if not 0 < num_layers < len(self.layers):
            raise ValueError(f"speculative_config.num_layers must be in [1, {len(self.layers) - 1}] "
                             f"(the model has {len(self.layers)} layers), got {num_layers}")
        config = dataclasses.replace(self.config, num_layers=num_layers)
        with torch.device("meta"):  # the shell only (this family's forward): every module is replaced by a shared one
            draft = type(self)(config, 1)
        for name, child in self.named_children():
            setattr(draft, name, nn.ModuleList(list(self.layers)[:num_layers]) if name == "layers" else child)
        for name, parameter in self.named_parameters(recurse=False):
            setattr(draft, name, parameter)
        return draft

    def use_native_stack(self) -> str | None:
        """Walk the decoder layers in one native call from now on, where a forward's
        cache and backend allow (call after ``pack_weights``; the weights must not move
        afterwards). Returns None, or why the model cannot (then the modules run)."""
        if self.modules_only is not None:
            return f"{self.config.architecture}'s layers ({self.modules_only}) run as modules"
        self.native_stack, reason = NativeDecoderStack.build(self)
        return None if self.native_stack is not None else reason

    # ---- loading ---------------------------------------------------------------------
    def weight_slice(self, hf_name: str) -> TensorSlice | None:
        """The part of checkpoint tensor ``hf_name`` this rank holds (None: all of it), by
        kvloom's name for it (the family's ``checkpoint_renames`` applied, as ``load_weights``
        applies them)."""
        name = rename(hf_name, self.checkpoint_renames)
        if self.config.classifier is not None and self.config.classifier.source_tokens and \
                name.removeprefix("model.") in ("lm_head.weight", "embed_tokens.weight"):
            return None  # whole: the head is a few tokens' rows, which any rank's share may lack (load_weights)
        return llama_weight_slice(self.config, name, self.tp.rank, self.tp.size, self.tp.expert_parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (each already cut to ``weight_slice``); raise if any
        parameter is left unset or a name is unknown."""
        filler = WeightFiller(self)
        # classifier_from_token: the head is the vocabulary head's rows of a few tokens
        # (the embedding's where the checkpoint ties its head and has no lm_head).
        source = self.config.classifier.source_token_ids if self.config.classifier is not None else ()
        embedding_rows: torch.Tensor | None = None
        # HF name fragment -> (our fused parameter fragment, offset, size), in this rank's shard
        attention = self.layers[0].self_attn
        q, kv = attention.q_size, attention.kv_size
        inter = self.config.intermediate_size // self.tp.size  # this rank's features of a dense MLP
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if source and name in ("lm_head.weight", "embed_tokens.weight"):
                assert self.config.classifier is not None
                head = tensor[list(source)]  # the source tokens' rows, in their order
                if self.config.classifier.two_way:  # one row: the second minus the first, in float32
                    head = (head[1:2].float() - head[0:1].float()).to(head.dtype)
                if name == "lm_head.weight":
                    filler.copy("lm_head.weight", head, hf_name)
                    continue
                embedding_rows = head  # and the embedding itself is read below
                if self.tp.size > 1:  # read whole (weight_slice): this rank's rows of it
                    tensor = tensor[self.embed_tokens.start:self.embed_tokens.end]
            if self.config.interleaved_rotary and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                tensor = halves_from_pairs(tensor, tensor.shape[0] // self.config.head_dim,  # this rank's heads
                                           self.config.rotary_dim)
            if self.tp.size > 1 and (".self_attn.qkv_proj." in name or ".mlp.gate_up_proj." in name):
                tensor = fused_rows(self.config, name, tensor, self.tp.rank, self.tp.size)  # Phi-3's, whole
            if name in ("score.weight", "score.bias") and self.config.classifier is not None:
                name = "lm_head." + name.split(".")[1]  # held where a causal model holds its vocabulary head
            if "rotary_emb" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            block = moe_block_name(name)
            if block is not None and block[0] < len(self.layers) and isinstance(self.layers[block[0]].mlp, SparseMoE):
                layer, inside = block
                for parameter, count in self.layers[layer].mlp.load_hf(inside, tensor).items():
                    filler.count(f"layers.{layer}.mlp.{parameter}", count)
                continue
            target, rows = name, None
            for fragment, (ours, start, length) in fused.items():
                if f".{fragment}." in name:
                    target, rows = name.replace(fragment, ours), slice(start, start + length)
                    break
            if target == "embed_tokens.weight" or (target in ("lm_head.weight", "lm_head.bias")
                                                   and self.config.classifier is None):
                rows = slice(0, self.embed_tokens.num_real_rows)  # the padding rows stay zero
            filler.copy(target, tensor, hf_name, rows)
        padding = (self.embed_tokens.weight.shape[0] - self.embed_tokens.num_real_rows) * self.config.hidden_size
        filler.finish_shard(padding, ("embed_tokens.weight",) if self.config.classifier
                            else ("embed_tokens.weight", "lm_head.weight"), self.tp.rank)
        if source and "lm_head.weight" not in filler.filled and embedding_rows is not None:
            filler.copy("lm_head.weight", embedding_rows, "model.embed_tokens.weight")
        filler.check_complete()


class StreamLayersForCausalLM(LlamaForCausalLM):
    """A family whose layers each take the residual stream and return it, their norms and
    adds inside (OLMo 2, Phi, GPT-NeoX, GPT-2, StableLM): ``layer(stream, rotary, batch,
    kv_cache, backend, metadata, rows)``, ``rows`` given to the last layer alone (the rows
    the step reads: every row's K and V still go into the cache). Llama's own walk fuses
    each residual add into the next norm instead."""

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The stream entering the first layer (GPT-2 adds its positions)."""
        return self.embed_tokens(batch.input_ids)

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """Returns the final hidden states, [tokens, hidden] (or the rows
        ``batch.output_rows`` names, whose last layer alone is computed)."""
        stream = self.embed(batch)
        full = self.rotary.cos_sin_for(batch) if len(self.config.no_rope_layers) < len(self.layers) else None
        local = self.local_rotary.cos_sin_for(batch) if self.local_rotary is not None else full
        stack = self.native_stack  # OLMo 2's and EXAONE 4's layers (the others' are modules only)
        if stack is not None and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None):
            tables = full if full is not None else self.rotary.cos_sin_for(batch)  # read by no layer then
            hidden, stream = stack(stream, tables, batch, kv_caches, backend, metadata,
                                   local if self.local_rotary is not None else None)
            return self.norm(hidden, stream)  # the rows batch.output_rows names, if any
        # The rows the step reads alone in the last layer, in one process (as Llama's forward).
        rows, last = batch.output_rows if self.tp.size == 1 else None, len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            rotary = None if index in self.config.no_rope_layers else local if layer.local_rope else full
            stream = layer(stream, rotary, batch, kv_caches[index], backend, metadata, rows if index == last else None)
        out: torch.Tensor = self.norm(stream)
        return out if rows is not None else batch.final_states(out)
