"""Expert parallel (``--enable-expert-parallel``) under two ranks on CPU: each rank holds
half of every mixture-of-experts layer's experts whole (attention, dense MLPs and shared
experts split as under tensor parallel), routes every token as one process does, runs the
tokens routed to its own experts, and one all-reduce sums both ranks' experts. Greedy tokens
and first logprobs are transformers' in float32 (Mixtral; Qwen2-MoE with a shared expert and
a dense layer; Qwen3-MoE; DeepSeek-V3's latent attention); an adapter on the experts is PEFT's; in bf16
the native walk, the other rank's pairs left out, gives the module path's tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.config import ModelConfig
from kvloom.models.moe import SparseMoE
from kvloom.models.sharding import TensorSlice, moe_weight_slice, tensor_parallel_problem

MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, q_lora_rank=24, n_group=2, topk_group=1)
MODELS = {
    "mixtral": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      intermediate_size=96, mlp_only_layers=[1]),
    "qwen3_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32),
    "deepseek_v3": MLA,
}
RNG = random.Random(12)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (9, 30)]


@pytest.mark.parametrize("arch", list(MODELS))
def test_two_ranks_of_whole_experts_give_transformers_greedy_tokens(arch: str, tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=13, **MODELS[arch])
    llm = assert_greedy_is_transformers(path, PROMPTS, 6, tensor_parallel_size=2, enable_expert_parallel=True)
    moe = next(layer.mlp for layer in llm.engine.model.model.layers if isinstance(layer.mlp, SparseMoE))
    full = llm.engine.model_config.moe  # rank 0 holds experts 0 and 1 of 4, each whole
    assert (moe.first_expert, moe.num_local_experts, moe.intermediate_size) == (0, 2, full.intermediate_size)


def test_a_lora_adapter_on_the_experts_is_pefts(tmp_path: Path) -> None:
    """Each rank keeps its experts' slices of A and B whole (no feature cut)."""
    import torch
    import transformers
    from helpers_lora import check_against_peft, peft, write_adapter
    base = write_tiny_hf_model(tmp_path / "mixtral", arch="mixtral", seed=14, **MODELS["mixtral"])
    adapter = write_adapter(base, tmp_path / "adapter", 1, 8, ["q_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(base), dtype="float32", num_blocks=48, block_size=16, enable_lora=True, max_lora_rank=8,
             tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        outputs = llm.generate(PROMPTS, params, lora_request=LoRARequest("a", 1, str(adapter)))
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    reference = peft.PeftModel.from_pretrained(model, adapter).eval()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])


def test_experts_are_cut_whole_and_must_divide() -> None:
    def mixtral(experts: int) -> ModelConfig:
        return ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 16,
                                    "intermediate_size": 30, "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "num_key_value_heads": 4, "num_local_experts": experts, "num_experts_per_tok": 2})
    moe = mixtral(6).moe
    assert moe is not None
    assert moe_weight_slice(moe, "experts.gate_up_proj", 1, 2, expert_parallel=True) == TensorSlice(0, 3, 6)
    assert moe_weight_slice(moe, "experts.4.w1.weight", 1, 2, expert_parallel=True) is None  # rank 1's: whole
    assert moe_weight_slice(moe, "experts.1.w2.weight", 1, 2, expert_parallel=True) == TensorSlice(0, 0, 0)  # none
    assert moe_weight_slice(moe, "gate.weight", 1, 2, expert_parallel=True) is None  # the router: every rank's
    # Four ranks: 30 features a expert do not split, 8 experts do; 6 experts do not.
    assert "experts' intermediate size (30)" in (tensor_parallel_problem(mixtral(8), 4) or "")
    assert tensor_parallel_problem(mixtral(8), 4, expert_parallel=True) is None
    assert "num_experts (6)" in (tensor_parallel_problem(mixtral(6), 4, expert_parallel=True) or "")


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_the_native_walk_leaves_out_the_other_ranks_experts_as_the_modules(arch: str, tmp_path: Path) -> None:
    """bf16 on CPU, two ranks of whole experts: the walk runs the rank's experts alone (the other
    rank's pairs left out, every token's sum all-reduced) and gives the module path's tokens with
    the same collectives; its stack holds the rank's experts (rank 0: 0 and 1 of 4)."""
    path = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=15, **MODELS[arch])
    runs = {}
    for stack in ("native", "modules"):
        with LLM(str(path), dtype="bfloat16", num_blocks=48, block_size=16, tensor_parallel_size=2,
                 enable_expert_parallel=True, decoder_stack=stack) as llm:
            native = llm.engine.model.model.native_stack
            assert (native is not None) == (stack == "native")
            if native is not None:
                assert (native.shape.moe.first_expert, native.shape.moe.local_experts) == (0, 2)
            outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            stats = llm.engine.stats()
            runs[stack] = ([list(o.outputs[0].token_ids) for o in outputs], stats.tp_collectives,
                           stats.tp_collective_bytes)
    assert runs["native"] == runs["modules"]
