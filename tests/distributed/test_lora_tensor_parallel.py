"""LoRA adapters under tensor parallel (two ranks on CPU): each rank holds its part of
every adapter, cut as the weights are, and its o and down deltas are partial sums the
all-reduce completes. In float32 each request's tokens are PEFT's (teacher-forced, the
logprobs within 1e-4), beside the base model's in one batch, with an adapter loaded while
the engine runs; in bf16 the native walk's steps are the module path's bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_lora import FAMILY_TARGETS, TARGETS_ALL, check_against_peft, reference_model, write_adapter
from helpers_models import write_tiny_hf_model

from kvloom import LLM, LoRARequest, SamplingParams

ENGINE = dict(device="cpu", num_blocks=48, block_size=16, max_num_batched_tokens=48, max_num_seqs=8,
              enable_lora=True, max_lora_rank=8, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-lora")
    # head_dim 32 (the native walk's paired layout in bf16); 4 heads, 2 KV heads: 2 ranks split them.
    base = write_tiny_hf_model(root / "base", seed=5, hidden_size=128, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2)
    return {"base": base, "a": write_adapter(base, root / "a", 1, 8, TARGETS_ALL),
            "b": write_adapter(base, root / "b", 2, 4, ["q_proj", "v_proj", "o_proj", "down_proj"])}


def workload() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(6)]


def test_two_ranks_serve_each_adapter_as_peft_computes_it(models: dict[str, Path]) -> None:
    prompts = workload()
    a, b = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    loras = [a, None, b, a, None, b]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(models["base"]), dtype="float32", **ENGINE) as llm:
        first = llm.generate(prompts[:2], params, lora_request=loras[:2])  # a loads on both ranks
        outputs = first + llm.generate(prompts[2:], params, lora_request=loras[2:])  # then b, while a stays
        llm.engine.check_integrity()
    references = {name: reference_model(models["base"], None if name is None else models[name])
                  for name in ("a", "b", None)}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        check_against_peft(references[lora.lora_name if lora else None], prompt, output.outputs[0])
    assert len({tuple(o.outputs[0].token_ids) for o in outputs[:3]}) == 3  # the adapters change the replies


def test_in_bf16_the_native_walk_is_the_module_path_bit_for_bit(models: dict[str, Path]) -> None:
    prompts = workload()
    loras = [LoRARequest("a", 1, str(models["a"])), None, LoRARequest("b", 2, str(models["b"]))] * 2
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for stack in ("native", "modules"):
        with LLM(str(models["base"]), dtype="bfloat16", decoder_stack=stack, **ENGINE) as llm:
            outputs = llm.generate(prompts, params, lora_request=loras)
            walk = llm.engine.model.model.native_stack
            assert (walk is not None and walk.lora is not None) == (stack == "native")  # rank 0's walk has the table
            runs[stack] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert runs["native"] == runs["modules"]


# Families whose adapters are cut otherwise than Llama's seven projections, and their shapes.
CUT_FAMILIES = {
    # Phi-3's adapter on qkv_proj and gate_up_proj: each rank keeps its share of each part's rows
    # of B (q, k and v; gate and up), as its fused weights hold them.
    "phi3": dict(intermediate_size=256),
    # StarCoder2's on c_fc and c_proj (its un-gated MLP's up and down): each rank keeps its
    # features' rows of c_fc's B and columns of c_proj's A.
    "starcoder2": dict(intermediate_size=256, norm_epsilon=1e-5),
}


@pytest.mark.parametrize("arch", list(CUT_FAMILIES))
def test_two_ranks_cut_a_familys_adapter_as_its_weights(arch: str, tmp_path: Path) -> None:
    base = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=6, hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2, **CUT_FAMILIES[arch])
    adapter = write_adapter(base, tmp_path / "adapter", 1, 8, FAMILY_TARGETS[arch][0])
    prompts = workload()[:3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(base), dtype="float32", **ENGINE) as llm:
        outputs = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, str(adapter)))
    reference = reference_model(base, adapter)
    for prompt, output in zip(prompts, outputs, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])


MOE = {"mixtral": (dict(intermediate_size=64, num_local_experts=4), ["q_proj", "o_proj"]),
       # a shared expert, and layer 1 dense: every linear layer PEFT finds adapted
       "qwen2_moe": (dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                          intermediate_size=96, mlp_only_layers=[1]),
                     ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


@pytest.mark.parametrize("arch", list(MOE))
def test_two_ranks_cut_an_expert_adapter_as_the_experts(tmp_path: Path, arch: str) -> None:
    """An adapter on the routed experts (PEFT's target_parameters) and attention (and
    Qwen2-MoE's shared expert and dense MLP): each rank keeps, per expert, its features' gate
    and up rows of B and down's columns of A, so the experts' down deltas are partial sums the
    layer's all-reduce completes."""
    import torch
    import transformers
    from helpers_lora import peft
    shape, targets = MOE[arch]
    base = write_tiny_hf_model(tmp_path / arch, arch=arch, seed=8, hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2, num_experts_per_tok=2, **shape)
    adapter = write_adapter(base, tmp_path / "adapter", 1, 8, targets,
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    prompts = workload()[:4]
    loras = [LoRARequest("a", 1, str(adapter)), None] * 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    # PEFT 0.22 makes the adapter's gate and up modules one on the experts' fused tensor,
    # of rank 2r (its rank_pattern): the slots hold that.
    with LLM(str(base), dtype="float32", **{**ENGINE, "max_lora_rank": 16}) as llm:
        outputs = llm.generate(prompts, params, lora_request=loras)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    reference = peft.PeftModel.from_pretrained(model, adapter).eval()
    for prompt, output in zip(prompts[0::2], outputs[0::2], strict=True):
        check_against_peft(reference, prompt, output.outputs[0])
    with reference.disable_adapter():
        for prompt, output in zip(prompts[1::2], outputs[1::2], strict=True):
            check_against_peft(reference, prompt, output.outputs[0])

