"""Qwen3 (``Qwen3ForCausalLM``): Llama's layers with each query and key head RMS-normed
before the rotary. Its greedy tokens and log-probs against transformers are in
test_hf_parity.py, Qwen3-MoE's in test_moe.py, the native walk's steps against the
module path's bit for bit in test_decoder_stack.py; here the default dtype's exactness
(a request's bf16 tokens alone equal its tokens batched, chunked and after a prefix hit,
in the native walk), tensor parallel (the norms' weights, one head's worth, on every
rank), GGUF files and LoRA adapters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import run_arrivals, token_ids
from helpers_models import hf_greedy_with_cache, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

RNG = random.Random(9)
SHARED = [RNG.randrange(3, 500) for _ in range(40)]
PROMPTS = [SHARED + [RNG.randrange(3, 500) for _ in range(n)] for n in (3, 17, 33)]
PROMPTS += [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 50)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 and block 16: the paired KV layout, as the default model's.
    return write_tiny_hf_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", block_size=16, num_blocks=128, **kwargs))


def test_bf16_tokens_alone_equal_batched_chunked_and_after_a_prefix_hit(qwen3: Path) -> None:
    alone = {}
    for index, prompt in enumerate(PROMPTS):
        one = engine(qwen3, enable_prefix_caching=False)
        alone[f"r{index}"] = token_ids(run_arrivals(one, {0: [(f"r{index}", prompt, GREEDY)]}))[f"r{index}"]
    together = engine(qwen3, max_num_batched_tokens=24)  # chunked; the later prompts hit the shared prefix
    arrivals = {2 * index: [(f"r{index}", prompt, GREEDY)] for index, prompt in enumerate(PROMPTS)}
    assert token_ids(run_arrivals(together, arrivals)) == alone
    assert together.stats().prefix_cache_hit_tokens >= 2 * 32
    assert together.model.native_stack is not None  # the native walk ran these steps (norms included)
    assert together.kv_manager.num_available_blocks == 128


def test_two_ranks_give_transformers_greedy_tokens(qwen3: Path) -> None:
    import torch
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    expected = [hf_greedy_with_cache(reference, prompt, 8) for prompt in PROMPTS[:3]]
    with LLM(str(qwen3), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_a_gguf_file_gives_transformers_greedy_tokens(qwen3: Path, tmp_path: Path) -> None:
    """llama.cpp's qwen3 files: Q/K rows as HF has them (not permuted), the norms as
    attn_q_norm / attn_k_norm, head_dim as attention.key_length."""
    import torch
    import transformers
    from helpers_models import write_tiny_gguf

    reference = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    llm = LLM(str(write_tiny_gguf(qwen3, tmp_path / "qwen3.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == "Qwen3ForCausalLM"
    outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy_with_cache(reference, p, 8)
                                                               for p in PROMPTS[:3]]


def test_a_lora_adapter_is_peft_on_qwen3(qwen3: Path, tmp_path: Path) -> None:
    """PEFT adds q_proj's and k_proj's deltas before the per-head norms; so does kvloom
    (the delta is added to the fused QKV output, which the norms then read)."""
    from helpers_lora import TARGETS_ALL, check_against_peft, reference_model, write_adapter

    from kvloom import LoRARequest

    adapter = write_adapter(qwen3, tmp_path / "adapter", 1, 4, TARGETS_ALL)
    llm = LLM(str(qwen3), dtype="float32", block_size=16, num_blocks=64, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS[3:], params, lora_request=LoRARequest("a", 1, str(adapter)))
    reference = reference_model(qwen3, adapter)
    for prompt, output in zip(PROMPTS[3:], outputs, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])
