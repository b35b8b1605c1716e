"""LG AI's EXAONE 4.0 (``Exaone4ForCausalLM``): OLMo 2's layer (each block's output normed, then
added to the stream; no input norm) with Llama's RMSNorms and a query and key RMSNorm of each
head (Qwen3's), and its hybrid attention: three sliding-window layers in four (config.json's
``layer_types``, from ``sliding_window_pattern``), the rotary in those only, the global layers
without position encoding (NoPE: ``config.no_rope_layers``).

The native walk runs its layers, as OLMo 2's; tensor parallel too (its q/k norms are of a head).
"""

from __future__ import annotations

from kvloom.models.layers import RMSNorm
from kvloom.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    norm_class = RMSNorm
    head_norms = True  # LlamaAttention's own q/k norms of a head (config.qk_norm)


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    layer_class = Exaone4DecoderLayer
    norm_class = RMSNorm
