"""LoRA adapters written by PEFT, and PEFT's own forward as the reference for kvloom's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")  # in the test extras: never skipped by `make test`
transformers = pytest.importorskip("transformers")

TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, out: Path, seed: int, rank: int, targets: list[str], **config) -> Path:
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


def reference_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers' model of ``base`` in float32, with PEFT's ``adapter`` if given."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
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
