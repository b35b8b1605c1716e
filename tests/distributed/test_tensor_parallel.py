"""Tensor parallel on CPU (gloo, rank processes spawned by the engine): greedy tokens
are transformers' own, and seeded samples are those of one process, through chunked
prefill, prefix hits and preemption.

Only one process group exists per process, so each test builds its engine and shuts
it down (``with LLM(...)``) before the next one starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import hf_greedy_with_cache, write_tiny_hf_model

from kvloom import LLM, SamplingParams

# A pool of 24 blocks for requests of up to 7 blocks each, 48-token steps: requests
# are preempted and prefills are chunked; the prompts share a 40-token prefix.
ENGINE = dict(dtype="float32", device="cpu", num_blocks=24, block_size=16, max_num_batched_tokens=48,
              max_num_seqs=8)
SHARED = [(7 * i + 3) % 500 + 5 for i in range(40)]
PROMPTS = [SHARED + [(13 * i + j) % 500 + 5 for j in range(10 + 9 * i)] for i in range(6)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tp") / "tiny", seed=3)


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, q/k/v, o and MLP biases, a vocabulary that 2 does not divide."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("tp") / "odd", seed=4, tie_word_embeddings=True,
                               attention_bias=True, mlp_bias=True, vocab_size=509)


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]


def test_tp2_greedy_is_transformers_and_seeded_samples_are_one_processs(tiny: Path) -> None:
    reference = hf_model(tiny)
    expected = [hf_greedy_with_cache(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    seeded = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with LLM(str(tiny), **ENGINE) as single:
        single_samples = [list(o.outputs[0].token_ids) for o in single.generate(PROMPTS, seeded)]
    with LLM(str(tiny), tensor_parallel_size=2, **ENGINE) as llm:
        assert greedy(llm, PROMPTS) == expected
        stats = llm.engine.stats()
        # The paths named above were taken, not just available.
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
        assert stats.num_block_copies > 0  # hits ending inside block 2 of the 40-token prefix: every rank copied
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, seeded)] == single_samples
        llm.engine.check_integrity()
        group = llm.engine.first_rank.group
        assert group.shm is not None and group.stats.calls > 0  # the shared-memory collectives ran


def test_tp2_with_biases_tied_head_and_a_padded_vocabulary_over_gloo(odd: Path) -> None:
    """Also the steps' collectives over gloo (``shared_memory=False``: what ranks on
    different hosts use) rather than shared memory, and speculative decoding (prompt
    lookup): its verification chunks send several logits rows per request."""
    reference = hf_model(odd)
    prompts = [prompt[:30] for prompt in PROMPTS[:3]]
    expected = [hf_greedy_with_cache(reference, prompt, 16) for prompt in prompts]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(str(odd), tensor_parallel_size=2, shared_memory=False, speculative_config=ngram, **ENGINE) as llm:
        assert llm.engine.first_rank.group.shm is None
        assert greedy(llm, prompts, 16) == expected
        assert llm.engine.stats().num_draft_tokens > 0


def test_tp2_bf16_prompt_logprobs_within_bf16_tolerance(tiny: Path) -> None:
    """bf16 cannot be bit-identical to one process: each rank's partial sums of the
    o/down projections are rounded to bf16 before the all-reduce adds them (one rounding
    more than a single matmul). Teacher-forced logprobs stay within bf16's error of
    transformers' float32 ones."""
    prompt = PROMPTS[5]
    reference = hf_model(tiny)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with LLM(str(tiny), tensor_parallel_size=2, **{**ENGINE, "dtype": "bfloat16"}) as llm:
        output = llm.generate([prompt], params)[0]
    got = torch.tensor([next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]])
    assert torch.allclose(got, expected, atol=0.15), (got - expected).abs().max()


def test_the_default_model_in_three_ranks_is_transformers(default_model_reference: torch.nn.Module) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks divide them, 2 do not."""
    reference = default_model_reference
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1001, 42, 7, 2203, 30]]
    expected = [hf_greedy_with_cache(reference, prompt, 12) for prompt in prompts]
    with LLM("smollm2-135m-instruct", tensor_parallel_size=3, dtype="float32", num_blocks=32) as llm:
        assert greedy(llm, prompts, 12) == expected
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's num_attention_heads \(9\)"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2, dtype="float32", num_blocks=32)



def test_one_steps_collectives_are_counted_and_exported(tiny: Path) -> None:
    """A 3-token prompt, one token out: one step. Its collectives, counted by hand for the
    tiny model (hidden 64, 2 layers, vocabulary 512 split in two, float32):
    the step's header (8 int64) and packed batch (3 ids + 3 positions + 3 slots + a
    1-block table + 1 length + 2 query starts + 1 logits row = 14 int64); 2 x 2 + 1
    all-reduces of [3, 64]; the logits header, the row's hidden [1, 64] and the gather
    of rank 0's [1, 256] logits."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvloom.server.metrics import EngineMetrics

    expected_calls = 2 + 5 + 3
    expected_bytes = 8 * 8 + 14 * 8 + 5 * 3 * 64 * 4 + 8 * 8 + 64 * 4 + 256 * 4
    with LLM(str(tiny), tensor_parallel_size=2, **ENGINE) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
        stats = llm.engine.stats()
    assert (stats.tp_collectives, stats.tp_collective_bytes) == (expected_calls, expected_bytes)
    metrics = EngineMetrics()
    metrics.record_state(stats)
    exported = {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
                for sample in family.samples}
    assert exported["kvloom:tp_collectives_total"] == expected_calls
    assert exported["kvloom:tp_collective_bytes_total"] == expected_bytes
    assert exported["kvloom:tp_collective_seconds_total"] > 0


def test_tp2_native_stack_is_the_module_path_bit_for_bit(tmp_path: Path) -> None:
    """bf16 on CPU: each rank walks its layers in one native call, all-reducing between
    kernels through the same shared-memory function (and collective numbers) as the
    module path: the same tokens, the same collectives."""
    path = write_tiny_hf_model(tmp_path / "hd32", seed=6, hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2)  # head_dim 32: the paired KV layout's
    assert_two_ranks_walk_as_the_modules(path)


def assert_two_ranks_walk_as_the_modules(path: Path) -> None:
    """bf16 on two ranks: the native walk (built on rank 0's model) gives the module path's
    tokens with the same collectives, counted and sized."""
    engine = {**ENGINE, "dtype": "bfloat16"}
    runs = {}
    for stack in ("native", "modules"):
        with LLM(str(path), tensor_parallel_size=2, decoder_stack=stack, **engine) as llm:
            assert (llm.engine.model.model.native_stack is not None) == (stack == "native")
            tokens = greedy(llm, PROMPTS)
            stats = llm.engine.stats()
            runs[stack] = (tokens, stats.tp_collectives, stats.tp_collective_bytes)
    assert runs["native"] == runs["modules"]


# Mixture-of-experts and latent-attention layers walked under tensor parallel: Qwen2-MoE (every
# expert's features and the gated shared expert's split, the layer's sum all-reduced) and DeepSeek-V3
# (each rank's heads of the latent attention, o_proj's partial sums all-reduced; experts by groups
# with a float32 router beside a shared expert, a dense first layer).
TP_WALKED = {
    "qwen2_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96),
    "deepseek_v3": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                        q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, n_group=2, topk_group=1, intermediate_size=64),
}


@pytest.mark.parametrize("arch", sorted(TP_WALKED))
def test_tp2_native_stack_runs_experts_and_latent_attention_as_the_modules(arch: str, tmp_path: Path) -> None:
    """bf16 on CPU, two ranks: the walk runs these layers (its stack built on every rank) and gives
    the module path's tokens with the same collectives."""
    assert_two_ranks_walk_as_the_modules(write_tiny_hf_model(tmp_path / arch, arch=arch, seed=7, **TP_WALKED[arch]))
