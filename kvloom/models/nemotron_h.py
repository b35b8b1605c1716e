"""NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H, Nemotron Nano 2, Nemotron 3): a stack
of single-mixer blocks, each an RMSNorm, then one of a Mamba2 mixer, an attention layer without
position encoding, a squared-ReLU MLP, or (Nemotron 3) a mixture of squared-ReLU experts beside
a shared one, added to the residual stream.

The mixers are Mamba2's (models/mamba2.py, their state in the requests' state slots; on
a CPU one native call a layer); the attention layers are Llama's over the paged pool of
the attention layers only (``kv_layer``), turning no rotary; the MLPs are ``UngatedMLP``;
the MoE blocks ``SparseMoE`` (DeepSeek-V3's router in float32, experts of up and down alone,
``MoEConfig.gated`` False). Its norms multiply by their weight in float32 before the cast
(``Float32ScaledRMSNorm``). transformers 5.25's modeling_nemotron_h.py is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.attention.cpu_paged import CPUPagedBackend
from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models import ssm_ops
from kvloom.models.decoder_stack import NativeDecoderStack, WalkLayer
from kvloom.models.layers import Float32ScaledRMSNorm, UngatedMLP, VocabParallelEmbedding
from kvloom.models.llama import LlamaAttention
from kvloom.models.mamba2 import Mamba2Mixer, allocate_mixer_state, load_named_weights
from kvloom.models.moe import SparseMoE
from kvloom.models.packed_linear import pack_with_tied_head
from kvloom.models.registry import CausalLM
from kvloom.models.weights import WeightFiller, rename

# Nemotron-H's checkpoint names -> these modules' (``rename``: each fragment in order).
NEMOTRON_H_NAMES = (("backbone.", ""), ("mixer.up_proj", "mixer.fc1"), ("mixer.down_proj", "mixer.fc2"))


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, kind: str) -> None:
        super().__init__()
        assert config.ssm is not None
        self.kind = kind
        self.norm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(config.hidden_size, config.ssm)
        elif kind == "attention":
            self.mixer = LlamaAttention(config)
        elif kind == "moe":
            assert config.moe is not None  # MoEConfig.from_hf names the MoE blocks
            self.mixer = SparseMoE(config.hidden_size, config.moe)
        else:
            self.mixer = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size,
                                    config.mlp_bias, config.hidden_act)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        if config.ssm is None or tp.size > 1:
            raise ValueError(f"{config.architecture} needs an SSM config and runs in one process")
        self.config, self.ssm, self.tp = config, config.ssm, tp
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = [NemotronHBlock(config, kind) for kind in config.ssm.layer_kinds]
        self.layers = nn.ModuleList(self.blocks)  # registered; ``blocks`` is the typed view
        self.kv_layer = {layer: rank for rank, layer in enumerate(config.ssm.attention_layers)}
        self.norm_f = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings else
                                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # The blocks walked in one native call (models/decoder_stack.py), once asked for by
        # use_native_stack; the module path below is the reference and the fallback.
        self.native_stack: NativeDecoderStack | None = None

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        """The final hidden states [tokens, hidden]; kv_caches holds the attention layers."""
        spans = ssm_ops.SSMSpans.of(batch, self.ssm.conv_kernel)
        residual = self.embeddings(batch.input_ids)  # the residual stream, added to in place
        stack = self.native_stack
        if (stack is not None and isinstance(backend, CPUPagedBackend)  # serves() holds it to that
                and stack.serves(kv_caches, backend, metadata, batch.lora_slots is not None)):
            unread = (torch.empty(batch.num_tokens, self.config.head_dim),) * 2  # no block turns a rotary
            walked, stream = stack(residual, unread, batch, kv_caches, backend, metadata, spans=spans)
            final: torch.Tensor = self.norm_f(walked, stream)
            return final  # the rows batch.output_rows names, if any
        hidden: torch.Tensor | None = None  # the previous block's output, not yet added to the stream
        for index, block in enumerate(self.blocks):
            # The norm first adds the previous block's output into the stream (HF's `residual + hidden`).
            normed = block.norm(residual) if hidden is None else block.norm(hidden, residual)
            if block.kind == "mamba":
                hidden = block.mixer(normed, spans)
            elif block.kind == "attention":  # no position encoding
                hidden = block.mixer(normed, None, batch, kv_caches[self.kv_layer[index]], backend, metadata)
            else:
                hidden = block.mixer(normed)
        assert hidden is not None  # a model has a layer
        out: torch.Tensor = self.norm_f(hidden, residual)
        return batch.final_states(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embeddings.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def allocate_state(self, num_slots: int) -> int:
        return allocate_mixer_state(self, num_slots)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        attention = [block.mixer for block in self.blocks if block.kind == "attention"]
        q, kv = (attention[0].q_size, attention[0].kv_size) if attention else (0, 0)
        fused = {"mixer.q_proj": ("mixer.qkv_proj", 0, q), "mixer.k_proj": ("mixer.qkv_proj", q, kv),
                 "mixer.v_proj": ("mixer.qkv_proj", q + kv, kv)}
        filler = WeightFiller(self)

        def dense(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            """The tensors of every block but the MoE ones, which go to their block's load_hf."""
            for name, tensor in named:
                name = rename(name, NEMOTRON_H_NAMES)
                parts = name.split(".", 3)  # layers, N, mixer, the name inside the block
                block = (self.blocks[int(parts[1])] if len(parts) == 4 and parts[0] == "layers" and parts[2] == "mixer"
                         and parts[1].isdigit() and int(parts[1]) < len(self.blocks) else None)
                if block is not None and isinstance(block.mixer, SparseMoE):
                    for target, count in block.mixer.load_hf(parts[3], tensor).items():
                        filler.count(f"layers.{parts[1]}.mixer.{target}", count)
                    continue
                yield name, tensor

        load_named_weights(self, dense(weights), fused, filler)

    def weight_slice(self, hf_name: str) -> None:
        return None

    def pack_weights(self, matmul: str = "invariant") -> int:
        return pack_with_tied_head(self, self.embeddings.weight, matmul)

    def walk_layers(self) -> list[WalkLayer]:
        """The blocks paired as the native walk's layers: a mixer or attention block and the
        MLP block after it; one with no MLP after it alone; an MLP block after no other alone."""
        layers: list[WalkLayer] = []
        index = 0
        while index < len(self.blocks):
            block = self.blocks[index]
            follower = self.blocks[index + 1] if index + 1 < len(self.blocks) else None
            if block.kind in ("mlp", "moe"):
                layers.append(WalkLayer("none", None, None, None, block.norm, block.mixer))
                index += 1
                continue
            mlp = follower if follower is not None and follower.kind in ("mlp", "moe") else None
            layers.append(WalkLayer(block.kind, block.norm, block.mixer if block.kind == "attention" else None,
                                    block.mixer if block.kind == "mamba" else None,  # type: ignore[arg-type]
                                    None if mlp is None else mlp.norm, None if mlp is None else mlp.mixer,
                                    self.kv_layer.get(index, 0)))
            index += 1 if mlp is None else 2
        return layers

    def use_native_stack(self) -> str | None:
        """Walk the blocks in one native call from now on (paired as ``walk_layers``), where a
        forward's cache and backend allow (after ``pack_weights``). None, or why it cannot."""
        self.native_stack, reason = NativeDecoderStack.build(self)
        return None if self.native_stack is not None else reason

    def first_layers(self, num_layers: int) -> CausalLM:
        raise ValueError("layer_skip drafts are not supported for state-space models")
