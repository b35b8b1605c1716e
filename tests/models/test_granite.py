"""IBM Granite (dense, ``GraniteForCausalLM``): Llama's layers with four multipliers (the
embedding's, each block's output before the residual add, the attention scores' in place
of 1/sqrt(head_dim), the logits' divisor). Greedy tokens and the first log-probs held to
transformers in float32 (chunked; both attention backends), llama.cpp's granite GGUF
files too, two ranks; bf16 alone equals batched and chunked in the native walk (its steps
equal the modules' bit for bit: test_decoder_stack.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import hf_greedy_and_first_logprobs as reference_run
from helpers_models import write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(21)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 7, 18, 40)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
# Multipliers far from 1 (Granite 3's are of this size), so a missing one cannot pass.
SCALES = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
              logits_scaling=8.0)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("granite"), arch="granite", seed=3, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, **SCALES)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(granite: Path, backend: str) -> None:
    llm = LLM(str(granite), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16,
              attention_backend=backend)
    assert llm.engine.model_config.scales is not None
    for output, prompt in zip(llm.generate(PROMPTS, GREEDY), PROMPTS, strict=True):
        tokens, first = reference_run(granite, prompt, 8)
        assert list(output.outputs[0].token_ids) == tokens
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)


def test_a_gguf_file_gives_transformers_greedy_tokens(granite: Path, tmp_path: Path) -> None:
    """llama.cpp's granite files: Llama's tensors (Q/K rows permuted) and the multipliers
    as embedding_scale, residual_scale, attention.scale and logit_scale."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(granite, tmp_path / "granite.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == "GraniteForCausalLM"
    outputs = llm.generate(PROMPTS[:3], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(granite, p, 8)[0] for p in PROMPTS[:3]]


def test_bf16_tokens_alone_equal_batched_and_chunked(granite: Path) -> None:
    together = bf16_alone_equals_batched(str(granite), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))
    assert together.model.native_stack is not None  # the walk scales each block's output too


def test_two_ranks_give_transformers_greedy_tokens(granite: Path) -> None:
    with LLM(str(granite), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS[:2], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(granite, p, 8)[0]
                                                                   for p in PROMPTS[:2]]


def test_granite_moe_gives_transformers_greedy_tokens_and_logprobs(tmp_path: Path) -> None:
    """GraniteMoe (``GraniteMoeForCausalLM``): Granite's multipliers over a Mixtral-routed
    MoE (a softmax over the top-k router logits), its hub tensors (``input_linear``,
    ``output_linear``, ``router.layer``) read into kvloom's experts; float32, two ranks and
    llama.cpp's GGUF file."""
    path = write_tiny_hf_model(tmp_path / "granite_moe", arch="granite_moe", seed=4, hidden_size=128,
                               intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=6, num_experts_per_tok=2, **SCALES)
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.model_config.moe is not None and llm.engine.model_config.scales is not None
    for output, prompt in zip(llm.generate(PROMPTS, GREEDY), PROMPTS, strict=True):
        tokens, first = reference_run(path, prompt, 8)
        assert list(output.outputs[0].token_ids) == tokens
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)
    with LLM(str(path), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as ranks:
        outputs = ranks.generate(PROMPTS[:2], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, 8)[0] for p in PROMPTS[:2]]
    # llama.cpp's granitemoe files: the experts split into ffn_gate_exps / ffn_up_exps, stacked.
    from helpers_models import write_tiny_gguf_family
    gguf = LLM(str(write_tiny_gguf_family(path, tmp_path / "granite_moe.gguf")), dtype="float32", block_size=16,
               num_blocks=64)
    assert gguf.engine.model_config.architecture == "GraniteMoeForCausalLM"
    outputs = gguf.generate(PROMPTS[:2], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, 8)[0] for p in PROMPTS[:2]]
