"""LoRA adapters with speculative decoding. Drafts are verified in the target's forward,
each request's rows through its own adapter, so the output is what it is without
speculation: in bf16 (the native walk: a head size the paired layout serves) bit for bit,
tokens and logprobs, greedy and seeded; in float32 each request's tokens are PEFT's.
A layer_skip draft runs the target's first layers with the request's adapter: its
guesses are PEFT's greedy tokens on those layers. n-gram guesses from the request's own
tokens, a separate draft model as for the base model (which only moves acceptance)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_lora import TARGETS_ALL, check_against_peft, reference_model, write_adapter
from helpers_models import write_tiny_hf_model

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.models.decoder_stack import NativeDecoderStack

# head_dim 32: the native walk runs the bf16 steps, adapter rows and drafts included.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-spec")
    base = write_tiny_hf_model(root / "base", arch="llama", **SHAPE)
    return {"base": base,
            "a": write_adapter(base, root / "a", 1, 8, TARGETS_ALL),
            "b": write_adapter(base, root / "b", 2, 4, ["q_proj", "v_proj", "o_proj", "down_proj"])}


def proposer(name: str, base: Path) -> dict:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
            "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3, "adaptive": False},
            # The base model as its own draft: the base requests' drafts are all accepted.
            "draft": {"method": "draft", "model": str(base), "num_speculative_tokens": 3, "adaptive": False}}[name]


def workload(models: dict[str, Path]) -> tuple[list[list[int]], list[LoRARequest | None], list[SamplingParams]]:
    """Six prompts that repeat a phrase (n-gram drafts find matches), two per adapter and
    two on the base model, greedy and seeded-sampled alternately."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(6)] * 4 + [rng.randrange(3, 500) for _ in range(3)]
               for _ in range(6)]
    a, b = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)
    return prompts, [a, b, None, b, a, None], [greedy, seeded] * 3


@pytest.mark.parametrize("name", ["ngram", "layer_skip", "draft"])
def test_in_bf16_every_request_is_speculation_offs_bit_for_bit(models, name: str, monkeypatch) -> None:
    prompts, loras, params = workload(models)
    walked: list[tuple[int, list[int], list[int]]] = []  # the walks' steps: which walk, adapter slots, query lengths
    walk = NativeDecoderStack.__call__

    def recorded(self, residual, rotary, batch, *rest):
        if batch.lora_slots is not None:
            walked.append((id(self), batch.lora_slots, batch.query_lens_list))
        return walk(self, residual, rotary, batch, *rest)

    monkeypatch.setattr(NativeDecoderStack, "__call__", recorded)
    plain = LLM(str(models["base"]), dtype="bfloat16", num_blocks=128, enable_lora=True, max_lora_rank=8)
    expected = plain.generate(prompts, params, lora_request=loras)
    walked.clear()  # the speculating engine's walks only
    llm = LLM(str(models["base"]), dtype="bfloat16", num_blocks=128, enable_lora=True, max_lora_rank=8,
              speculative_config=proposer(name, models["base"]))
    got = llm.generate(prompts, params, lora_request=loras)
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids, index
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs, index
    assert len({tuple(o.outputs[0].token_ids) for o in got[:3]}) == 3  # the adapters change the replies
    # The target's walk verified adapter requests' drafts (2-5 rows of one sequence: prompts are 27 long) ...
    target = id(llm.engine.model.native_stack)
    assert any(walk == target and slot >= 0 and 2 <= rows <= 5
               for walk, slots, lens in walked for slot, rows in zip(slots, lens, strict=True))
    if name == "layer_skip":  # ... and a layer_skip draft's walk ran adapter rows too
        assert any(walk != target and max(slots) >= 0 for walk, slots, _ in walked)
    speculation = llm.engine.scheduler.speculation
    assert speculation is not None and speculation.num_draft_tokens > 0
    if name != "layer_skip":  # one random layer of three guesses nothing right; the others do
        assert speculation.num_accepted_tokens > 0
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_in_float32_each_adapters_tokens_are_pefts(models) -> None:
    prompts, loras, params = workload(models)
    greedy = [params[0]] * len(prompts)
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True, max_lora_rank=8,
              speculative_config=proposer("ngram", models["base"]))
    outputs = llm.generate(prompts, greedy, lora_request=loras)
    references = {name: reference_model(models["base"], None if name is None else models[name])
                  for name in ("a", "b", None)}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        check_against_peft(references[lora.lora_name if lora else None], prompt, output.outputs[0])
    assert llm.engine.scheduler.speculation.num_accepted_tokens > 0
    llm.engine.check_integrity()


def test_layer_skip_guesses_are_pefts_greedy_tokens_on_the_first_layers(models) -> None:
    """Every proposal, for an adapter's request and the base model's, is the greedy
    continuation of the request's tokens by transformers' first two layers (then the
    final norm and head) with PEFT's adapter on them, or without one."""
    import transformers
    from helpers_lora import greedy_tokens, peft

    prompts, loras, params = workload(models)
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True, max_lora_rank=8,
              speculative_config={"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3,
                                  "adaptive": False})
    proposals: list[tuple[str, list[int], list[int]]] = []
    propose = llm.engine.proposer.propose

    def recorded(requests, num_tokens):
        before = [(request.request_id, list(request.all_token_ids)) for request in requests]
        drafts = propose(requests, num_tokens)
        proposals.extend((rid, tokens, draft) for (rid, tokens), draft in zip(before, drafts, strict=True))
        return drafts

    llm.engine.proposer.propose = recorded
    outputs = llm.generate(prompts, [params[0]] * len(prompts), lora_request=loras)
    adapter_of = {output.request_id: lora for output, lora in zip(outputs, loras, strict=True)}

    def first_layers(adapter: Path | None):
        model = transformers.AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32,
                                                                  num_hidden_layers=2).eval()
        return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()

    references = {name: first_layers(None if name is None else models[name]) for name in ("a", "b", None)}
    checked = {name: 0 for name in references}
    for request_id, tokens, draft in proposals:
        lora = adapter_of[request_id]
        name = lora.lora_name if lora else None
        assert draft == greedy_tokens(references[name], tokens, len(draft)), (request_id, len(tokens))
        checked[name] += len(draft)
    assert all(count >= 10 for count in checked.values()), checked
    llm.engine.check_integrity()
