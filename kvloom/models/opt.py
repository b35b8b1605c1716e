"""Meta's OPT (``OPTForCausalLM``: OPT-125m, vLLM's first example, to OPT-66b): GPT-2's layer
(pre-LayerNorm, weights and biases, the blocks in turn, Llama's attention called with no
rotary) with separate q, k and v projections, a ReLU MLP (fc1, fc2), learned absolute
positions added to the token embeddings (row p + 2 for position p: the table keeps two rows
ahead, transformers' offset), a final LayerNorm and the embedding as the output head.

OPT-350m's post-LayerNorm layers and embedding projections are refused by name (config.py).
The native walk runs its layers (ReLU: cpu_ops.relu); tensor parallel as StarCoder2's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.batch import ForwardBatch
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models.gpt_neox import GPTNeoXDecoderLayer
from kvloom.models.layers import ResidualLayerNorm
from kvloom.models.llama import StreamLayersForCausalLM
from kvloom.models.weights import renamed

# Checkpoint names -> the Llama modules that hold them (with or without the "model." prefix:
# facebook/opt-* checkpoints start at "decoder."). The model's final LayerNorm first: the
# layers' own are named final_layer_norm too.
_RENAMES = (("decoder.final_layer_norm.", "norm."), ("decoder.layers.", "layers."),
            ("decoder.embed_tokens.", "embed_tokens."), ("decoder.embed_positions.", "embed_positions."),
            ("self_attn_layer_norm.", "input_layernorm."), ("final_layer_norm.", "post_attention_layernorm."),
            ("self_attn.out_proj.", "self_attn.o_proj."), (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))
POSITION_OFFSET = 2  # transformers' OPTLearnedPositionalEmbedding: position p reads row p + 2


class OPTForCausalLM(StreamLayersForCausalLM):
    has_score_head = False  # no OPT sequence classifier is read
    checkpoint_renames = _RENAMES
    layer_class = GPTNeoXDecoderLayer  # GPT-2's layer, its blocks in turn (config.parallel_residual is off)
    norm_class = ResidualLayerNorm  # the final LayerNorm

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(config, max_positions, tp)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.embed_tokens(batch.input_ids) + self.embed_positions(batch.positions + POSITION_OFFSET)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, _RENAMES))
