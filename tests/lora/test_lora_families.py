"""LoRA adapters on the families whose projections keep Llama's names but whose layers
differ around them: each held to PEFT's forward in float32 (greedy tokens and logprobs).
Where the deltas land matters in each: Gemma 2's softcapped scores and block norms, Gemma 3's
q/k head norms and local rotary, OLMo 2's q/k norms over the whole projection (after the
delta), OLMo 1's clip (after the delta), EXAONE 4's global layer without rotary, Granite's
multipliers. (Phi, GPT-2, GPT-NeoX, StarCoder2, Phi-3, StableLM, Qwen3 and ERNIE 4.5 have
theirs in their own test files.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_lora import TARGETS_ALL, assert_adapter_is_peft
from helpers_models import write_tiny_hf_model

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)
MIXED = ["sliding_attention", "full_attention"]
FAMILIES = {
    "gemma2": dict(head_dim=32, sliding_window=20, query_pre_attn_scalar=19, attn_logit_softcapping=0.5),
    "gemma3": dict(head_dim=32, sliding_window=20, query_pre_attn_scalar=19, layer_types=MIXED),
    "olmo2": {},
    "olmo": dict(clip_qkv=0.5),
    "exaone4": dict(head_dim=32, sliding_window=20, layer_types=MIXED),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0),
}
RNG = random.Random(3)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (9, 30)]  # the longer one past the window


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_an_adapter_on_every_projection_is_peft(arch: str, tmp_path: Path) -> None:
    model = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=5, **SHAPE, **FAMILIES[arch])
    assert_adapter_is_peft(model, tmp_path / "adapter", PROMPTS, TARGETS_ALL)
