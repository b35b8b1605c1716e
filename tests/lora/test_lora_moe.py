"""LoRA adapters on mixture-of-experts models (tiny Mixtral and Qwen2-MoE): adapters on
the attention projections and on the routed experts (PEFT's ``target_parameters`` on
transformers' fused expert tensors), against PEFT's forward with transformers' own model
(its experts run eagerly); in bf16 an adapter's rows are the same alone or batched with
others'; adapters the experts cannot take are refused by name, and the engine serves on."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from helpers_lora import check_against_peft, peft, write_adapter
from helpers_models import write_tiny_hf_model
from safetensors.torch import load_file, save_file

from kvloom import LLM, LoRARequest, SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-moe")
    mixtral = write_tiny_hf_model(root / "mixtral", arch="mixtral", seed=1, num_local_experts=4,
                                  num_experts_per_tok=2, intermediate_size=64)
    # Layer 0 sparse with a shared expert, layer 1 dense (mlp_only_layers).
    qwen2_moe = write_tiny_hf_model(root / "qwen2_moe", arch="qwen2_moe", seed=2, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)
    # Qwen3-MoE (Qwen3-30B-A3B's family): per-head q/k norms, experts in every layer.
    qwen3_moe = write_tiny_hf_model(root / "qwen3_moe", arch="qwen3_moe", seed=6, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    return {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe,
            # Every projection and both expert tensors, as an "all-linear" Qwen3-MoE adapter has them.
            "qwen3_moe-all": write_adapter(qwen3_moe, root / "qwen3_moe-all", 6, 8, ATTENTION,
                                           target_parameters=EXPERTS),
            "mixtral-a": write_adapter(mixtral, root / "mixtral-a", 1, 8, ATTENTION),
            "qwen2_moe-a": write_adapter(qwen2_moe, root / "qwen2_moe-a", 2, 4, ATTENTION),
            # The experts alone (both tensors: PEFT nests the two wrappers), rank 8.
            "mixtral-experts": write_adapter(mixtral, root / "mixtral-experts", 3, 8, None,
                                             target_parameters=EXPERTS),
            # Layer 0's down_proj alone (no nesting) beside the attention's, rank 4.
            "qwen2_moe-experts": write_adapter(qwen2_moe, root / "qwen2_moe-experts", 4, 4, ATTENTION,
                                               target_parameters=["model.layers.0.mlp.experts.down_proj"]),
            # Every linear layer PEFT finds (the shared expert's, the dense layer's MLP) and the experts.
            "qwen2_moe-all": write_adapter(qwen2_moe, root / "qwen2_moe-all", 5, 4,
                                           [*ATTENTION, "gate_proj", "up_proj", "down_proj"],
                                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])}


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


@pytest.mark.parametrize("name", ["mixtral-experts", "qwen2_moe-experts", "qwen2_moe-all", "qwen3_moe-all"])
def test_an_adapter_on_the_experts_is_pefts_beside_the_base_model(models: dict[str, Path], name: str) -> None:
    arch = name.split("-")[0]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    adapter = LoRARequest("experts", 1, str(models[name]))
    loras = [adapter, None, adapter, None]
    llm = LLM(str(models[arch]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=loras)
    reference = peft_model(models[arch], models[name])
    if name == "qwen2_moe-all":  # PEFT adapted the shared expert and the dense layer's MLP too
        adapted = {n.split(".lora_A")[0] for n, _ in reference.named_parameters() if "lora_A" in n}
        assert any("shared_expert.gate_proj" in n for n in adapted) and any("1.mlp.down_proj" in n for n in adapted)
    assert sum("lora_A" in name and "experts" in name for name, _ in reference.named_parameters()) > 0
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        if lora is not None:
            check_against_peft(reference, prompt, output.outputs[0])
    with reference.disable_adapter():
        for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
            if lora is None:
                check_against_peft(reference, prompt, output.outputs[0])
    assert outputs[0].outputs[0].token_ids != llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    llm.engine.check_integrity()


def test_an_expert_adapters_rows_in_bf16_are_the_same_alone_or_batched(models: dict[str, Path]) -> None:
    """Exactness with adapters on the experts: each request's tokens and logprobs are the
    same whatever shares its steps (other adapters, the base model), bit for bit."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    experts, attention = (LoRARequest("experts", 1, str(models["mixtral-experts"])),
                          LoRARequest("attention", 2, str(models["mixtral-a"])))
    loras = [experts, None, attention, experts, None]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(str(models["mixtral"]), dtype="bfloat16", num_blocks=64, enable_lora=True, max_lora_rank=8)
    batched = llm.generate(prompts, params, lora_request=loras)
    for prompt, lora, output in zip(prompts, loras, batched, strict=True):
        alone = llm.generate([prompt], params, lora_request=lora)[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == (output.outputs[0].token_ids, output.outputs[0].logprobs)
    base = llm.generate([prompts[0]], params)[0].outputs[0]
    assert batched[0].outputs[0].logprobs != base.logprobs  # the adapter is at work
    llm.engine.check_integrity()


def test_expert_adapters_the_model_cannot_take_are_refused_by_name(models: dict[str, Path], tmp_path: Path) -> None:
    llm = LLM(str(models["qwen2_moe"]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=8)
    source = models["qwen2_moe-experts"]
    tensors = load_file(str(source / "adapter_model.safetensors"))
    config = json.loads((source / "adapter_config.json").read_text())
    down = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"  # [hidden, rank * experts]
    cases = {
        # LoRA on the router's tensor
        "router": ({**config, "target_parameters": ["mlp.gate.weight"]}, tensors,
                   "target_parameters must name mixture-of-experts tensors"),
        # B for 2 experts where the model has 4
        "shape": (config, {**tensors, down: tensors[down][:, :8].contiguous()},
                  r"layer 0's experts.down_proj has A \(16, 32\) and B \(64, 8\); the model's 4 experts need"),
        # layer 1 is dense (mlp_only_layers)
        "dense": (config, {**tensors, down.replace("layers.0", "layers.1"): tensors[down].clone(),
                           "base_model.model.model.layers.1.mlp.experts.lora_A.weight":
                               tensors["base_model.model.model.layers.0.mlp.experts.lora_A.weight"].clone()},
                  "layer 1 has no mixture-of-experts FFN"),
        # tensors at a depth target_parameters does not explain (two nested, one named)
        "unnamed": (config, {**tensors, "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight":
                             torch.zeros(16, 64)}, "that target_parameters .* does not name"),
    }
    for number, (case, (settings, weights, message)) in enumerate(cases.items(), start=2):
        out = tmp_path / case
        out.mkdir()
        save_file(weights, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(settings))
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), lora_request=LoRARequest(case, number, str(out)))
    served = LoRARequest("experts", 1, str(source))
    reply = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), lora_request=served)[0].outputs[0]
    assert len(reply.token_ids) == 3  # serving on
    llm.engine.check_integrity()


def merged_checkpoint(base: Path, out: Path, deltas: dict[str, torch.Tensor]) -> Path:
    """``base``'s checkpoint with ``deltas`` added to the named weights: an adapter merged
    by hand, the reference for an adapter format PEFT on transformers 5 no longer writes."""
    import shutil
    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    for name, delta in deltas.items():
        weights[name] = weights[name] + delta
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("arch, patterns", [("mixtral", False), ("qwen2_moe", False), ("mixtral", True)])
def test_an_adapter_on_each_experts_own_modules_is_its_merged_weights(models: dict[str, Path], arch: str,
                                                                      patterns: bool, tmp_path: Path) -> None:
    """transformers 4's experts were modules (Mixtral's experts.N.w1 / w3 / w2, the others'
    experts.N.gate_proj ...), and the hub's adapters for them are per expert: served as the
    fused tensors' (gate's and up's stacked), the tokens and logprobs are those of transformers
    on the base weights with each B A merged in by hand. Experts 0-2 of 4 adapted, expert 3 not.
    With ``patterns``, expert 1 has rank 2 and expert 2's w2 rank 6 and alpha 3 (PEFT's
    rank_pattern / alpha_pattern): the stacked parts as wide as their widest expert."""
    from helpers_lora import reference_model
    rank, alpha = 4, 8
    rank_pattern = {r"experts\.1\.w\d": 2, r"experts\.2\.w2": 6} if patterns else {}
    alpha_pattern = {r"2\.w2": 3} if patterns else {}
    names = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")), "qwen2_moe": ("mlp", ("gate_proj", "up_proj",
                                                                                      "down_proj"))}
    block, modules = names[arch]
    hidden, inter = 64, (64 if arch == "mixtral" else 32)
    generator = torch.Generator().manual_seed(9)
    tensors, deltas = {}, {}
    for layer in (0, 1) if arch == "mixtral" else (0,):  # Qwen2-MoE's layer 1 is dense
        for expert in range(3):
            for module in modules:
                rows, columns = (hidden, inter) if module in ("w2", "down_proj") else (inter, hidden)
                path = f"model.layers.{layer}.{block}.experts.{expert}.{module}"
                own_rank = next((r for key, r in rank_pattern.items() if re.search(key, path)), rank)
                own_alpha = next((a for key, a in alpha_pattern.items() if re.search(key, path)), alpha)
                a = torch.randn(own_rank, columns, generator=generator) * 0.3
                b = torch.randn(rows, own_rank, generator=generator) * 0.3
                tensors[f"base_model.model.{path}.lora_A.weight"] = a
                tensors[f"base_model.model.{path}.lora_B.weight"] = b
                deltas[f"{path}.weight"] = (own_alpha / own_rank) * b @ a
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                             "target_modules": list(modules),
                                                             "rank_pattern": rank_pattern,
                                                             "alpha_pattern": alpha_pattern}))
    reference = reference_model(merged_checkpoint(models[arch], tmp_path / "merged", deltas), None,
                                experts_implementation="eager")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    llm = LLM(str(models[arch]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=LoRARequest("hub", 1, str(adapter)))
    base = llm.generate(prompts, params)
    for prompt, output, plain in zip(prompts, outputs, base, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])
        assert output.outputs[0].logprobs[0] != plain.outputs[0].logprobs[0]
    llm.engine.check_integrity()
