"""EleutherAI's GPT-J (``GPTJForCausalLM``: GPT-J-6B, and the models tuned from it): Phi's layer
(attention and MLP side by side on one LayerNorm, added together to the stream: attention + MLP
+ stream) with q, k, v and out_proj without biases, an un-gated ``gelu_new`` MLP (fc_in, fc_out)
with biases, a rotary that turns adjacent pairs of each head's first ``rotary_dim`` dimensions
(those q/k rows regrouped at load, ``config.interleaved_rotary``), a final LayerNorm and an output
head of its own, with a bias.

The native walk runs its layers; tensor parallel as Phi's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvloom.models.phi import PhiForCausalLM

# Checkpoint names -> the Llama modules that hold them.
_RENAMES = (("transformer.h.", "model.layers."), ("transformer.wte.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."), ("ln_1.", "input_layernorm."),
            ("attn.q_proj.", "self_attn.q_proj."), ("attn.k_proj.", "self_attn.k_proj."),
            ("attn.v_proj.", "self_attn.v_proj."), ("attn.out_proj.", "self_attn.o_proj."),
            ("mlp.fc_in.", "mlp.fc1."), ("mlp.fc_out.", "mlp.fc2."))
# Buffers that older checkpoints saved beside the weights (the causal mask).
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPTJForCausalLM(PhiForCausalLM):
    """Phi's model (its head's bias too) under GPT-J's names."""

    checkpoint_renames = _RENAMES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor) for name, tensor in weights if not name.endswith(_BUFFERS))
