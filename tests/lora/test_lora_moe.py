"""LoRA adapters on mixture-of-experts models (tiny Mixtral and Qwen2-MoE): adapters on
the attention projections, against PEFT's forward with transformers' own model (its
experts run eagerly); an adapter on an expert layer's MLP is refused by name, and the
engine serves on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers_lora import check_against_peft, peft, write_adapter
from helpers_models import write_tiny_hf_model
from safetensors.torch import load_file, save_file

from kvloom import LLM, LoRARequest, SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-moe")
    mixtral = write_tiny_hf_model(root / "mixtral", arch="mixtral", seed=1, num_local_experts=4,
                                  num_experts_per_tok=2, intermediate_size=64)
    # Layer 0 sparse with a shared expert, layer 1 dense (mlp_only_layers).
    qwen2_moe = write_tiny_hf_model(root / "qwen2_moe", arch="qwen2_moe", seed=2, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)
    return {"mixtral": mixtral, "qwen2_moe": qwen2_moe,
            "mixtral-a": write_adapter(mixtral, root / "mixtral-a", 1, 8, ATTENTION),
            "qwen2_moe-a": write_adapter(qwen2_moe, root / "qwen2_moe-a", 2, 4, ATTENTION)}


def peft_model(base: Path, adapter: Path) -> torch.nn.Module:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    return peft.PeftModel.from_pretrained(model, adapter).eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_attention_adapter_is_pefts_beside_the_base_model(models: dict[str, Path], arch: str) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    adapter = LoRARequest("a", 1, str(models[f"{arch}-a"]))
    loras = [adapter, None, adapter, None]
    llm = LLM(str(models[arch]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=loras)
    reference = peft_model(models[arch], models[f"{arch}-a"])
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        if lora is not None:
            check_against_peft(reference, prompt, output.outputs[0])
    with reference.disable_adapter():  # the base model's rows beside them
        for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
            if lora is None:
                check_against_peft(reference, prompt, output.outputs[0])
    assert outputs[0].outputs[0].token_ids != llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    llm.engine.check_integrity()


def test_an_adapter_on_an_expert_layers_mlp_is_refused_by_name(models: dict[str, Path], tmp_path: Path) -> None:
    """The attention adapter plus a down_proj on layer 0 (sparse): refused, naming it; one on
    layer 1 (dense) is served, as a dense model's."""
    llm = LLM(str(models["qwen2_moe"]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=8)
    tensors = load_file(str(models["qwen2_moe-a"] / "adapter_model.safetensors"))
    config = json.loads((models["qwen2_moe-a"] / "adapter_config.json").read_text())
    hidden, inter = 64, 128  # the tiny model's hidden and (dense) intermediate sizes
    for layer, served in ((0, False), (1, True)):
        out = tmp_path / f"layer{layer}"
        out.mkdir()
        prefix = f"base_model.model.model.layers.{layer}.mlp.down_proj"
        save_file({**tensors, f"{prefix}.lora_A.weight": torch.randn(4, inter) * 0.1,
                   f"{prefix}.lora_B.weight": torch.randn(hidden, 4) * 0.1}, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({**config, "target_modules": [*ATTENTION, "down_proj"]}))
        request = LoRARequest(f"mlp{layer}", 2 + layer, str(out))
        if served:
            assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), lora_request=request)[0].finished
        else:
            with pytest.raises(ValueError, match="layer 0's down_proj is in a mixture-of-experts FFN"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), lora_request=request)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3  # serving on
    llm.engine.check_integrity()
