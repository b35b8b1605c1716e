"""Tiny random-weight state-space checkpoints (Mamba2, the Bamba and Granite 4.0 hybrids) written with
transformers' own config and model classes, and transformers' greedy tokens for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from helpers_models import CHATML_TEMPLATE, TINY_VOCAB_SIZE, tiny_tokenizer_json

# Small but with every feature in play: 2 groups over 4 heads, several SSD blocks per
# prompt (chunk_size 8), a 4-tap convolution.
_SETTINGS: dict[str, dict[str, Any]] = {
    "mamba2": dict(hidden_size=32, num_hidden_layers=2, vocab_size=TINY_VOCAB_SIZE, num_heads=4, head_dim=16,
                   state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, expand=2, tie_word_embeddings=False,
                   bos_token_id=0, eos_token_id=2, pad_token_id=0),
    "bamba": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE, attn_layer_indices=[1], mamba_n_heads=4,
                  mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  initializer_range=0.1,  # 0.02 (the default) makes a tiny model repeat one token
                  bos_token_id=0, eos_token_id=2, pad_token_id=0),
    # IBM Granite 4.0: Bamba's stack with Granite's multipliers (none of them 1, the attention's
    # not 1/sqrt(head_dim)), routed experts beside a shared MLP of another width, and rotary
    # (the published models have none: ``position_embedding_type=None``, a test's override).
    "granite_hybrid": dict(hidden_size=32, intermediate_size=48, shared_intermediate_size=40, num_hidden_layers=4,
                           layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE, mamba_n_heads=4, mamba_d_state=8,
                           mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=2,
                           num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
                           embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                           logits_scaling=2.0, max_position_embeddings=512, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, initializer_range=0.1,
                           bos_token_id=0, eos_token_id=2, pad_token_id=0),
    # LiquidAI LFM2: gated short convolutions (3 taps) and attention layers with per-head q/k norms;
    # the MLP's width as transformers adjusts it (2/3 of 96, rounded up to 16: 64).
    "lfm2": dict(hidden_size=32, intermediate_size=96, block_multiple_of=16, num_hidden_layers=4,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE, conv_L_cache=3, max_position_embeddings=512,
                 norm_eps=1e-5, initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0),
    # LFM2-MoE: LFM2's layers, the first dense (intermediate_size as it is), then 4 experts of 24
    # features, top 2 by sigmoid score steered by a float32 bias (perturbed below: not zero).
    "lfm2_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                     num_experts_per_tok=2, num_dense_layers=1, num_hidden_layers=4,
                     layer_types=["conv", "full_attention", "conv", "full_attention"], num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE, conv_L_cache=3,
                     max_position_embeddings=512, norm_eps=1e-5, initializer_range=0.1, bos_token_id=0,
                     eos_token_id=2, pad_token_id=0),
    # Nemotron-H: single-mixer blocks, Mamba2 (2 groups), attention without position encoding,
    # a squared-ReLU MLP.
    "nemotron_h": dict(hidden_size=32, intermediate_size=48, layers_block_type=["mamba", "attention", "mlp", "mamba"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=TINY_VOCAB_SIZE,
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4,
                       chunk_size=8, max_position_embeddings=512, layer_norm_epsilon=1e-5, initializer_range=0.1,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0),
    # Nemotron 3: Nemotron-H's blocks with MoE blocks: 4 squared-ReLU experts of 24 features in 2
    # groups, top 2 from the better group by sigmoid score steered by a float32 bias (perturbed
    # below), renormalised and scaled, beside a shared expert of 40; one MoE block after a mixer,
    # one after the attention, one last.
    "nemotron_h_moe": dict(hidden_size=32, intermediate_size=48,
                           layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "moe"],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=TINY_VOCAB_SIZE,
                           mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4,
                           chunk_size=8, max_position_embeddings=512, layer_norm_epsilon=1e-5, initializer_range=0.1,
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                           moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1, norm_topk_prob=True,
                           routed_scaling_factor=2.5, mlp_hidden_act="relu2"),
}
_CLASSES = {"mamba2": ("Mamba2Config", "Mamba2ForCausalLM"), "bamba": ("BambaConfig", "BambaForCausalLM"),
            "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
            "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"), "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM"),
            "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
            "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM")}


def write_tiny_ssm_model(path: str | Path, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight ``arch`` (mamba2 | bamba | granite_hybrid) HF directory with a tokenizer.
    Norm weights, biases and the mixers' A_log, D and dt_bias are perturbed from their
    initial values so that a loader that mixes two up is caught."""
    import transformers

    config_name, model_name = _CLASSES[arch]
    config = getattr(transformers, config_name)(**{**_SETTINGS[arch], **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "norm_f.weight")):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith((".bias", ".D", ".dt_bias", ".A_log")):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith((".expert_bias", ".e_score_correction_bias")):  # selection biases (zeros at init)
                buffer.add_(torch.randn_like(buffer) * 0.1)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE}))
    return path


def hf_greedy(path: Path, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
    """transformers' float32 greedy tokens (its own cache, one prompt at a time)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = {}
    with torch.no_grad():
        for request_id, prompt in prompts.items():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            results[request_id] = out[0, len(prompt):].tolist()
    return results


def random_prompts(count: int, seed: int, shortest: int = 3, longest: int = 40) -> dict[str, list[int]]:
    import random

    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(rng.randrange(shortest, longest))]
            for i in range(count)}


def ssm_engine(path: Path, **kwargs: Any) -> Any:
    """A float32 engine on ``path``; ``kwargs`` are engine options."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(str(path), dtype="float32", **kwargs))


def assert_preempted_requests_match_transformers(path: Path, prompts: dict[str, list[int]], max_tokens: int) -> Any:
    """``prompts`` arriving staggered (two at once, then one every two steps) into a pool of
    20 blocks of 4 tokens and 4 state slots, prefills chunked at 24 tokens: some request is
    preempted (its blocks and slot come back), some waits for a slot, and every request's
    float32 greedy tokens are transformers'; afterwards every block and slot is free.
    Returns the engine."""
    from helpers_engine import run_arrivals, token_ids

    from kvloom import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reference = hf_greedy(path, prompts, max_tokens)
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        arrivals.setdefault(0 if i < 2 else 2 * i, []).append((request_id, prompt, greedy))
    engine = ssm_engine(path, num_blocks=20, block_size=4, max_num_batched_tokens=24, num_state_slots=4)
    finals = run_arrivals(engine, arrivals)
    assert token_ids(finals) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.num_available_blocks == 20
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots
    return engine
