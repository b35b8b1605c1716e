"""LoRA adapters written by PEFT, and PEFT's own forward as the reference for kvloom's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")  # in the test extras: never skipped by `make test`
transformers = pytest.importorskip("transformers")

TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each family's own names of its projections, where they are not Llama's: every projection,
# and (second) one of the attention's input, its output and the MLP's output.
FAMILY_TARGETS = {
    "phi": (["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], ["q_proj", "dense", "fc2"]),
    "gpt2": (["c_attn", "c_proj", "c_fc"], ["c_attn", "c_proj"]),  # c_proj: the attention's and the MLP's
    "gpt_neox": (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                 ["query_key_value", "dense", "dense_4h_to_h"]),
    "starcoder2": (["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"], ["q_proj", "o_proj", "c_proj"]),
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "o_proj", "down_proj"]),
    "opt": (["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], ["q_proj", "out_proj", "fc2"]),
    "gptj": (["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"], ["q_proj", "out_proj", "fc_out"]),
    "falcon": (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
               ["query_key_value", "dense", "dense_4h_to_h"]),
    "glm": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], ["q_proj", "o_proj", "down_proj"]),
    "glm4": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], ["q_proj", "o_proj", "down_proj"]),
}


def family_targets(model_dir: Path) -> tuple[list[str], list[str]]:
    """The target_modules of an adapter on every projection of the model at ``model_dir``,
    and of one on a few (its family's names, from config.json's model_type)."""
    import json
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    return FAMILY_TARGETS.get(model_type, (TARGETS_ALL, ["q_proj", "v_proj", "o_proj", "down_proj"]))


def write_adapter(base: Path, out: Path, seed: int, rank: int, targets: list[str] | None, **config) -> Path:
    """A PEFT LoRA adapter with random A and B (B scaled down: the tiny model's replies
    stay varied), saved as PEFT saves it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                           init_lora_weights=False, **config)
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.2)
    adapted.save_pretrained(out)
    return out


def reference_model(base: Path, adapter: Path | None, **options) -> torch.nn.Module:
    """transformers' model of ``base`` in float32 (``from_pretrained``'s ``options``), with
    PEFT's ``adapter`` if given."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **options).eval()
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def check_against_peft(reference: torch.nn.Module, prompt: list[int], completion) -> None:
    """Teacher-forced on kvloom's tokens: each is PEFT's argmax there, at its logprob
    (``completion``: a CompletionOutput with logprobs)."""
    tokens = completion.token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    assert tokens == logits.argmax(dim=-1).tolist()
    for position, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(logprobs[position, token].item(), abs=1e-4)


def greedy_tokens(reference: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens, EOS a token like any other (``ignore_eos``)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def assert_adapter_is_peft(model_dir: Path, out: Path, prompts: list[list[int]], targets: list[str] | None,
                           **config) -> None:
    """An adapter of rank 4 on ``targets`` (the family's own names; ``config``: more of
    PEFT's LoraConfig), served in float32 from ``model_dir``: each prompt's greedy tokens
    and logprobs are PEFT's, and its first token's logprobs are not the base model's (the
    adapter is applied). Adapters on experts' tensors run against transformers' eager experts."""
    from kvloom import LLM, LoRARequest, SamplingParams

    adapter = write_adapter(model_dir, out, 1, 4, targets, **config)
    llm = LLM(str(model_dir), dtype="float32", block_size=16, num_blocks=64, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, str(adapter)))
    base = llm.generate(prompts, params)
    reference = reference_model(model_dir, adapter,
                                **({"experts_implementation": "eager"} if "target_parameters" in config else {}))
    for prompt, output, plain in zip(prompts, outputs, base, strict=True):
        check_against_peft(reference, prompt, output.outputs[0])
        first, base_first = output.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
        assert {t: e.logprob for t, e in first.items()} != {t: e.logprob for t, e in base_first.items()}
