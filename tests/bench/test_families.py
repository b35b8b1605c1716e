"""`kvloom bench families` on tiny shapes: the cache bytes per token and the concurrency
a memory budget holds, against the numbers computed by hand from each config; the
decode timing runs and reports every batch size."""

from __future__ import annotations

from pathlib import Path

from helpers_models import tiny_tokenizer_json

from kvloom.bench.families import format_families, run_families
from kvloom.tokenizer import Tokenizer

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=2)
SHAPES = {
    "llama": ("LlamaConfig", {**BASE, "num_key_value_heads": 2, "architectures": ["LlamaForCausalLM"]}),
    "mla": ("DeepseekV2Config", {**BASE, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
                                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                 "first_k_dense_replace": 2, "n_routed_experts": 2, "num_experts_per_tok": 1,
                                 "moe_intermediate_size": 8, "n_shared_experts": 1,
                                 "architectures": ["DeepseekV2ForCausalLM"]}),
}


def test_cache_bytes_concurrency_and_decode_rows(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(512))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", {"eos_token": "<|im_end|>"})
    results = run_families(["llama", "mla"], tmp_path / "models", [1, 3], 32, 2, 1 / 1024, {},
                           tokenizer=tokenizer, shapes=SHAPES)
    llama, mla = results
    # bf16: 2 layers x (K and V of 2 heads x 16) x 2 bytes; 2 layers x (32 + 8) x 2 bytes.
    assert (llama.cache_bytes_per_token, mla.cache_bytes_per_token) == (2 * 2 * 2 * 16 * 2, 2 * 40 * 2)
    assert (llama.max_requests, mla.max_requests) == ((1 << 20) // (256 * 32), (1 << 20) // (160 * 32))
    assert llama.state_bytes_per_request == mla.state_bytes_per_request == 0
    for result in results:
        assert set(result.decode) == {1, 3} and all(row["tokens_per_s"] > 0 for row in result.decode.values())
        assert result.prefix_hit_ms > 0 and result.state_copy_ms == 0  # (time_prefix_hit raises without a hit)
    assert "DeepseekV2ForCausalLM" in format_families(results, 32, 1 / 1024)


def test_a_state_space_model_holds_a_fixed_state_per_request(tmp_path: Path) -> None:
    """Mamba2: no KV at all; its state per request is every mixer's convolution inputs
    (model dtype, bf16) and SSM state (float32), counted by hand."""
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(512))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", {"eos_token": "<|im_end|>"})
    shapes = {"mamba2": ("Mamba2Config", dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_heads=4,
                                              head_dim=16, state_size=8, n_groups=2, conv_kernel=4, expand=2,
                                              bos_token_id=0, eos_token_id=2,
                                              architectures=["Mamba2ForCausalLM"]))}
    (result,) = run_families(["mamba2"], tmp_path / "models", [2], 32, 2, 1 / 1024, {}, tokenizer=tokenizer,
                             shapes=shapes)
    conv_dim = 64 + 2 * 2 * 8  # the inner width, then B and C of each group
    per_layer = conv_dim * (4 - 1) * 2 + 4 * 16 * 8 * 4
    assert (result.cache_bytes_per_token, result.state_bytes_per_request) == (0, 2 * per_layer)
    assert result.max_requests == (1 << 20) // (2 * per_layer)
    # The timed hit restored a state checkpoint (time_prefix_hit raises without the hit).
    assert result.prefix_hit_ms > 0 and result.state_copy_ms > 0
