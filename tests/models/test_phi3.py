"""Phi-3 (``Phi3ForCausalLM``): Llama's layers with its checkpoint's q/k/v and gate/up
already fused, and LongRoPE (per-pair rescaled rotary frequencies, the short factors within
the original context and the long ones past it, cos and sin scaled by the attention
factor). Greedy tokens and the first log-probs held to transformers in float32 (chunked),
LongRoPE both ways and over part of each head (Phi-4-mini's), and served past the original
context with the factors picked token by token as transformers' generate picks them; the default dtype's
exactness in the native walk; two ranks; what is not served refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import hf_greedy_and_first_logprobs as reference_run
from helpers_models import write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(13)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 6, 17, 33, 47)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def longrope(head_dim: int, original: int) -> dict:
    rng = random.Random(4)
    return {"rope_type": "longrope", "short_factor": [1 + rng.random() for _ in range(head_dim // 2)],
            "long_factor": [2 + 6 * rng.random() for _ in range(head_dim // 2)],
            "original_max_position_embeddings": original}


@pytest.mark.parametrize("rope", ["default", "longrope-short", "longrope-long", "partial-longrope"])
def test_greedy_tokens_and_logprobs_are_transformers(tmp_path: Path, rope: str) -> None:
    """Phi-4-mini's shape included: three quarters of each head rotated (its first 24 of
    32 dimensions, the rest passed), with LongRoPE over those."""
    overrides: dict = dict(SHAPE)
    if rope == "partial-longrope":
        overrides["partial_rotary_factor"] = 0.75
        rope = "longrope-long"
    llm_kwargs: dict = {}
    prompts = PROMPTS
    if rope != "default":
        rotary = int(32 * overrides.get("partial_rotary_factor", 1.0))
        overrides.update(max_position_embeddings=256, original_max_position_embeddings=32,
                         rope_scaling=longrope(rotary, 32))
        if rope == "longrope-short":  # served within the original context: the short factors
            llm_kwargs["max_model_len"] = 32
            prompts = [p for p in PROMPTS if len(p) + 8 <= 32]
        else:  # served past it: the long factors, which transformers takes past 32 tokens
            prompts = [p for p in PROMPTS if len(p) > 32]
    path = write_tiny_hf_model(tmp_path / rope, arch="phi3", seed=6, **overrides)
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16, **llm_kwargs)
    assert llm.engine.model_config.architecture == "Phi3ForCausalLM"
    for output, prompt in zip(llm.generate(prompts, GREEDY), prompts, strict=True):
        tokens, first = reference_run(path, prompt, 8)
        assert list(output.outputs[0].token_ids) == tokens
        ours = output.outputs[0].logprobs[0][tokens[0]].logprob
        assert ours == pytest.approx(first[tokens[0]].item(), abs=1e-4)


def test_bf16_tokens_alone_equal_batched_and_chunked_in_the_native_walk(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "phi3", arch="phi3", seed=2, head_dim=64, **SHAPE)
    together = bf16_alone_equals_batched(str(path), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))
    assert together.model.native_stack is not None


@pytest.mark.parametrize("rope", ["default", "longrope", "partial-longrope"])
def test_a_gguf_file_gives_transformers_greedy_tokens(tmp_path: Path, rope: str) -> None:
    """llama.cpp's phi3 files: attn_qkv and ffn_up fused as HF holds them (no row
    permutation), LongRoPE's factors as the rope_factors_long / _short tensors with the
    original context and the attention factor as metadata."""
    from helpers_models import write_tiny_gguf

    overrides: dict = dict(SHAPE)
    if rope != "default":
        rotary = 24 if rope == "partial-longrope" else 32  # rope.dimension_count: Phi-4-mini's part of a head
        overrides.update(max_position_embeddings=256, original_max_position_embeddings=32,
                         rope_scaling=longrope(rotary, 32), partial_rotary_factor=rotary / 32)
    path = write_tiny_hf_model(tmp_path / rope, arch="phi3", seed=7, **overrides)
    llm = LLM(str(write_tiny_gguf(path, tmp_path / f"{rope}.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == "Phi3ForCausalLM"
    prompts = [p for p in PROMPTS if len(p) > 32] if rope != "default" else PROMPTS[:3]  # the long factors
    for output, prompt in zip(llm.generate(prompts, GREEDY), prompts, strict=True):
        assert list(output.outputs[0].token_ids) == reference_run(path, prompt, 8)[0]


def test_two_ranks_give_transformers_greedy_tokens(tmp_path: Path) -> None:
    """Each rank reads the fused tensors whole and keeps its share of q, k and v (of gate
    and up), in order, as its own fused layer holds them."""
    path = write_tiny_hf_model(tmp_path / "phi3", arch="phi3", seed=5, **SHAPE)
    with LLM(str(path), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS[:3], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, 8)[0] for p in PROMPTS[:3]]


def test_what_phi3_is_not_served_for_is_refused_by_name(tmp_path: Path) -> None:
    partial = write_tiny_hf_model(tmp_path / "partial", arch="phi3", partial_rotary_factor=0.3, **SHAPE)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.3 gives 9 rotary dimensions"):
        LLM(str(partial), dtype="float32", block_size=16, num_blocks=16)


def test_an_adapter_on_its_fused_projections_is_peft(tmp_path: Path) -> None:
    """Phi-3's checkpoints fuse q/k/v (qkv_proj) and gate/up (gate_up_proj), and so do its
    adapters: each part takes its rows of B, the one A shared."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    path = write_tiny_hf_model(tmp_path / "phi3", arch="phi3", seed=3, **SHAPE)
    assert_adapter_is_peft(path, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["phi3"][0])


def test_longrope_served_past_the_original_context_picks_factors_as_transformers_generate(tmp_path: Path) -> None:
    """Served with contexts past the original 32 tokens, a request turns by the short
    factors while it stays within them and by the long ones from there on, and a prompt
    longer than 32 by the long ones throughout: transformers' generate (its KV-cached
    forwards each pick the factors by their own length: the prompt's one, then a token at a
    time). The prefix cache keeps a long prompt's blocks apart from a short prompt's that
    share its tokens (they are turned otherwise), so each gets its own."""
    from helpers_models import hf_greedy_with_cache

    path = write_tiny_hf_model(tmp_path / "phi3", arch="phi3", seed=6, max_position_embeddings=256,
                               original_max_position_embeddings=32, rope_scaling=longrope(32, 32), **SHAPE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    shared = PROMPTS[4][:20]
    prompts = [PROMPTS[1], PROMPTS[2], shared, shared + PROMPTS[3][:20], PROMPTS[4]]  # 6, 17, 20: short; 40, 47: long
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.long_rope_from == 32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # 17 + 16 and 20 + 16 cross 32
    for prompt in prompts:  # one at a time: the long prompt after the short one it begins with
        output = llm.generate([prompt], params)[0].outputs[0]
        assert list(output.token_ids) == hf_greedy_with_cache(reference, prompt, 16), len(prompt)
    together = llm.generate(prompts, params)  # and batched, each request's factors its own
    assert [list(o.outputs[0].token_ids) for o in together] == [
        hf_greedy_with_cache(reference, prompt, 16) for prompt in prompts]


def test_longrope_factors_by_token_on_two_ranks(tmp_path: Path) -> None:
    """Every rank turns each token as rank 0 does (the flags travel with the step)."""
    from helpers_models import hf_greedy_with_cache

    path = write_tiny_hf_model(tmp_path / "phi3", arch="phi3", seed=6, max_position_embeddings=256,
                               original_max_position_embeddings=32, rope_scaling=longrope(32, 32), **SHAPE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    prompts = [PROMPTS[2], PROMPTS[4]]  # 17 tokens (crossing 32 as it generates), 47 (long throughout)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        hf_greedy_with_cache(reference, prompt, 16) for prompt in prompts]
