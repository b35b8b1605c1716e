"""YaRN rope scaling: the frequencies and the cos/sin factor against transformers'
own computation, and greedy tokens identical to transformers on tiny Qwen2 and
DeepSeek-V2 checkpoints whose config asks for YaRN (DeepSeek's published ones do)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_models import hf_greedy_tokens, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.models.layers import rope_attention_factor, rope_inverse_frequencies

YARNS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5,
     "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "attention_factor": 1.25},
]


@pytest.mark.parametrize("scaling", YARNS)
def test_yarn_is_transformers(scaling: dict) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=512,
                                      rope_parameters={"rope_theta": 10000.0, **scaling})
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(32, 10000.0, scaling), expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)



@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v2"])
def test_yarn_models_give_transformers_tokens(arch: str, tmp_path: Path) -> None:
    import transformers
    overrides = dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0})
    if arch == "deepseek_v2":
        overrides.update(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2,
                         n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, n_shared_experts=1)
    path = write_tiny_hf_model(tmp_path / arch, arch=arch, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 90)]  # past the original 32
    outputs = LLM(str(path), dtype="float32", num_blocks=64).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy_tokens(reference, p, 8) for p in prompts]
