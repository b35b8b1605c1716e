"""AllenAI's OLMoE: Llama's layers with q/k RMSNorms over the whole projections and a softmax
router's top-k of gated SiLU experts in every layer (renormalised where norm_topk_prob). Greedy
tokens and first log-probs held to transformers in float32 with and without the renormalisation,
bf16 alone equal to batched and chunked, a LoRA adapter on the attention held to PEFT and one on
the router refused by name; its clip_qkv and two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM, LoRARequest, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(41)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
             num_experts_per_tok=2)


@pytest.fixture(scope="module", params=[False, True], ids=["raw_top_k", "renormalised"])
def olmoe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("olmoe"), arch="olmoe", seed=101, norm_topk_prob=request.param,
                               **SHAPE)


def test_greedy_tokens_and_logprobs_are_transformers(olmoe: Path) -> None:
    config = assert_greedy_is_transformers(olmoe, PROMPTS, 12).engine.model_config
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (8, 2)
    assert config.moe.sparse_layers == (0, 1)


def test_bf16_tokens_alone_equal_batched_and_chunked(olmoe: Path) -> None:
    bf16_alone_equals_batched(str(olmoe), PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def test_adapters_on_attention_and_experts_are_peft_and_one_on_the_router_is_refused(olmoe: Path,
                                                                                       tmp_path: Path) -> None:
    from helpers_lora import assert_adapter_is_peft, write_adapter

    assert_adapter_is_peft(olmoe, tmp_path / "attention", PROMPTS[2:], ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert_adapter_is_peft(olmoe, tmp_path / "experts", PROMPTS[2:], None,
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    # PEFT targets the router's bare weight as a parameter (target_parameters): not an expert's.
    router = write_adapter(olmoe, tmp_path / "router", 2, 4, ["q_proj", "gate"])
    llm = LLM(str(olmoe), dtype="float32", num_blocks=32, enable_lora=True)
    with pytest.raises(ValueError, match=r"target_parameters must name mixture-of-experts tensors .*got .*gate.weight"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), lora_request=LoRARequest("r", 1, str(router)))
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_two_ranks_give_transformers_greedy_tokens(olmoe: Path) -> None:
    """The q/k norms over every head: each rank's sums of squares all-reduced, its columns
    scaled; the experts split by their features."""
    assert_greedy_is_transformers(olmoe, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_what_it_cannot_run_is_refused_by_name(olmoe: Path, tmp_path: Path) -> None:
    clipped = write_tiny_hf_model(tmp_path / "olmoe-clip", arch="olmoe", seed=102, clip_qkv=4.0, **SHAPE)
    with pytest.raises(Exception, match="OLMoE's clip_qkv"):
        LLM(str(clipped), dtype="float32", num_blocks=16)
