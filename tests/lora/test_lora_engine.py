"""LoRA adapters against PEFT's own forward: adapters written by PEFT (``get_peft_model``
+ ``save_pretrained``) on a tiny random Llama, served by kvloom beside the base model,
each request's tokens and logprobs held to PEFT's model with that adapter (teacher-forced
on kvloom's tokens), in one batch that mixes adapters and the base model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers_lora import TARGETS_ALL, check_against_peft, reference_model, write_adapter
from helpers_models import write_tiny_hf_model

from kvloom import LLM, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_hf_model(root / "base", arch="llama")
    return {"base": base,
            "a": write_adapter(base, root / "a", 1, 4, ["q_proj", "v_proj", "o_proj", "down_proj"]),
            "b": write_adapter(base, root / "b", 2, 8, TARGETS_ALL, use_rslora=True),
            # Per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern, matched on the
            # module's name as PEFT does: a regular expression for its tail after a dot).
            "c": write_adapter(base, root / "c", 3, 4, TARGETS_ALL, use_rslora=True,
                               rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.\w+_proj": 2},
                               alpha_pattern={"o_proj": 3, "down_proj": 20})}


def peft_model(models: dict[str, Path], name: str | None) -> torch.nn.Module:
    return reference_model(models["base"], None if name is None else models[name])


def test_a_batch_of_two_adapters_and_the_base_model_is_peft_each(models) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    loras = [LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"])), None] * 2
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=loras)
    references = {name: peft_model(models, name) for name in ("a", "b", None)}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        check_against_peft(references[lora.lora_name if lora else None], prompt, output.outputs[0])
    # The adapters do change the replies (else the test could not tell them apart).
    assert len({tuple(o.outputs[0].token_ids) for o in outputs[:3]}) == 3
    # Embeddings through an adapter: PEFT's final hidden state of the last token.
    for prompt, lora, embedded in zip(prompts[:3], loras[:3], llm.embed(prompts[:3], lora_request=loras[:3]),
                                      strict=True):
        with torch.no_grad():
            hidden = references[lora.lora_name if lora else None](
                torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(hidden.float(), dim=-1)
        assert torch.allclose(torch.tensor(embedded.outputs.embedding), expected, atol=1e-5)
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_an_adapter_with_per_module_ranks_and_alphas_is_pefts(models) -> None:
    """Adapter c's q_proj has rank 8, layer 1's MLP rank 2 and the rest 4; o_proj's alpha 3,
    down_proj's 20 (layer 1's down_proj matches both patterns), the rest 8, each scaled by
    alpha / sqrt(rank) (rsLoRA): PEFT's model with it is the reference."""
    settings = json.loads((models["c"] / "adapter_config.json").read_text())
    assert settings["rank_pattern"] and settings["alpha_pattern"]  # as PEFT wrote it
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    loras = [LoRARequest("c", 3, str(models["c"])), None] * 2
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, lora_request=loras)
    reference, plain = peft_model(models, "c"), peft_model(models, None)
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        check_against_peft(reference if lora else plain, prompt, output.outputs[0])
    assert outputs[0].outputs[0].token_ids != llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    llm.engine.check_integrity()


def test_the_prefix_cache_keeps_each_adapters_kv_apart(models) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(70)]  # four whole blocks of 16
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    a = LoRARequest("a", 1, str(models["a"]))
    base_first = llm.generate([prompt], params)[0]
    adapted = llm.generate([prompt], params, lora_request=a)[0]
    assert adapted.num_cached_tokens == 0  # the base model's KV is not the adapter's
    again = llm.generate([prompt], params, lora_request=a)[0]
    assert again.num_cached_tokens == 69  # its own: whole blocks and the tail
    assert again.outputs[0].token_ids == adapted.outputs[0].token_ids
    check_against_peft(peft_model(models, "a"), prompt, again.outputs[0])
    salted = llm.generate([prompt], params, lora_request=a, cache_salt="tenant")[0]
    assert salted.num_cached_tokens == 0  # a salt keeps its own tree, per adapter too
    assert llm.generate([prompt], params)[0].num_cached_tokens == 69
    assert base_first.outputs[0].token_ids != adapted.outputs[0].token_ids
    llm.engine.check_integrity()


def test_in_bf16_every_request_is_bit_identical_alone_and_beside_others(models) -> None:
    """A step with adapter rows (here on the module path: the native walk, which
    tests/models/test_decoder_stack.py holds to it bit for bit, needs a head size this
    tiny model lacks): the base model's rows in it get the bits they get alone (in bf16,
    kvloom's row-invariant GEMM), and so do an adapter's rows, whose two matmuls run on
    that GEMM too."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(30)]
    others = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(str(models["base"]), dtype="bfloat16", num_blocks=128, enable_lora=True,
              enable_prefix_caching=False)
    alone = llm.generate([prompt], params)[0]
    a, b = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    mixed = llm.generate([others[0], prompt, others[1], others[2]], params, lora_request=[a, None, b, a])
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].outputs[0].logprobs == alone.outputs[0].logprobs
    for index, lora, batched in ((0, a, mixed[0]), (1, b, mixed[2]), (2, a, mixed[3])):  # alone, then as above
        solo = llm.generate([others[index]], params, lora_request=lora)[0].outputs[0]
        assert (solo.token_ids, solo.logprobs) == (batched.outputs[0].token_ids, batched.outputs[0].logprobs)


def test_a_request_waits_for_a_slot_and_slots_are_reused_least_recently_used(models) -> None:
    """One slot: a request on "b" while "a" runs waits in the queue (vLLM's behaviour) as
    base-model requests go past it, and a later request on "a" queues behind it rather
    than keep a's slot busy; each reply is its own adapter's (PEFT's)."""
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True, max_loras=1, trace=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    a, b = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    engine.add_request(prompt, params, request_id="with-a", lora_request=a)
    engine.step()  # with-a runs, holding the slot
    for request_id, lora in (("with-b", b), ("base", None), ("a-again", a)):
        engine.add_request(prompt, params, request_id=request_id, lora_request=lora)
    finished, admitted = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = (engine.scheduler.step_count, output)
        for request in engine.scheduler.running:
            admitted.setdefault(request.request_id, engine.scheduler.step_count)
        engine.check_integrity()
    waits = {request_id: reason for record in engine.scheduler.trace.records for request_id, reason in record.waiting}
    assert waits["with-b"] == waits["a-again"] == "LoRA slots busy"
    assert admitted["base"] == 2 and admitted["with-b"] > finished["with-a"][0] - 1
    assert admitted["a-again"] > finished["with-b"][0] - 1  # behind with-b, not beside with-a
    for request_id, name in (("with-a", "a"), ("with-b", "b"), ("base", None), ("a-again", "a")):
        check_against_peft(peft_model(models, name), prompt, finished[request_id][1].outputs[0])
    # A request whose adapter is unloaded while it waits ends with that error; the others go on.
    engine.add_request(prompt, params, request_id="runs", lora_request=b)
    engine.step()
    engine.add_request(prompt, params, request_id="orphan", lora_request=a)
    assert engine.remove_lora("a")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_integrity()
    assert outputs["orphan"].error.message == "LoRA adapter 'a' was unloaded while the request waited"
    check_against_peft(peft_model(models, "b"), prompt, outputs["runs"].outputs[0])
    a = LoRARequest("a", 1, str(models["a"]))
    # a is idle now: b takes its slot, and its replies are b's.
    check_against_peft(peft_model(models, "b"), prompt, llm.generate([prompt], params, lora_request=b)[0].outputs[0])
    check_against_peft(peft_model(models, "a"), prompt, llm.generate([prompt], params, lora_request=a)[0].outputs[0])
    with pytest.raises(ValueError, match=r"'a' was loaded from .*, not /elsewhere: one name, one adapter"):
        llm.generate([prompt], params, lora_request=LoRARequest("a", 3, "/elsewhere"))
    engine.check_integrity()
    # Removed, the name may name another adapter, whose KV is its own: the prompt that
    # "a" has cached is not a hit for the new "a".
    assert engine.remove_lora("a") and not engine.remove_lora("a")
    renamed = llm.generate([prompt], params, lora_request=LoRARequest("a", 4, str(models["b"])))[0]
    assert renamed.num_cached_tokens == 0
    check_against_peft(peft_model(models, "b"), prompt, renamed.outputs[0])
    assert engine.add_lora(LoRARequest("c", 5, str(models["a"])))  # checked and bound, loaded on first use
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("d", 6, "/no/such/adapter"))
    check_against_peft(peft_model(models, "a"), prompt,
                       llm.generate([prompt], params, lora_request=LoRARequest("c", 5, str(models["a"])))[0].outputs[0])
    engine.check_integrity()


def rewrite_config(source: Path, target: Path, **changes) -> Path:
    target.mkdir()
    (target / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    settings = json.loads((source / "adapter_config.json").read_text())
    settings.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(settings))
    return target


def test_adapters_that_cannot_be_served_are_refused_by_name(models, tmp_path) -> None:
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=64, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    other = write_tiny_hf_model(tmp_path / "wider", arch="llama", hidden_size=96, intermediate_size=160)
    cases = {
        str(tmp_path / "missing"): "no adapter_config.json",
        str(models["b"]): "rank 8 exceeds max_lora_rank 4",
        str(rewrite_config(models["a"], tmp_path / "dora", use_dora=True)): "use_dora=True is not supported",
        str(rewrite_config(models["a"], tmp_path / "embed", target_modules=["embed_tokens"])):
            "target_modules must be a list of",
        str(rewrite_config(models["a"], tmp_path / "wide", rank_pattern={"q_proj": 8})):
            r"model.layers.0.self_attn.q_proj has rank 8 \(rank_pattern\), above max_lora_rank 4",
        str(rewrite_config(models["a"], tmp_path / "narrow", rank_pattern={r"v_pro.": 2})):
            r"layer 0's v_proj has A \(4, 64\) and B \(32, 4\); the model needs A \(2, 64\) and B \(32, 2\)",
        str(rewrite_config(models["a"], tmp_path / "regex", alpha_pattern={"q_proj(": 2})):
            r"alpha_pattern key 'q_proj\(' is not a regular expression",
        str(rewrite_config(models["a"], tmp_path / "half", rank_pattern={"q_proj": 2.5})):
            "rank_pattern must map module names to a positive integer each",
        str(write_adapter(other, tmp_path / "wrong-shape", 3, 4, ["q_proj"])):
            r"layer 0's q_proj has A \(4, 96\) and B \(96, 4\); the model needs A \(4, 64\) and B \(64, 4\)",
    }
    for index, (path, message) in enumerate(cases.items(), start=1):
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], params, lora_request=LoRARequest(f"bad{index}", index, path))
        llm.engine.check_integrity()
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3  # still serving


def test_lora_needs_enable_lora_and_a_valid_request(models) -> None:
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="lora_request needs an engine started with enable_lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a", 1, str(models["a"])))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "x")


@pytest.mark.parametrize("max_cpu_loras, reads", [(None, 3), (2, 2)])
def test_adapters_kept_read_are_not_read_again(models, monkeypatch, max_cpu_loras, reads) -> None:
    """vLLM's --max-cpu-loras: one slot serving a, b, a in turn reads a from disk again
    only when fewer than two adapters are kept read; the replies are PEFT's either way."""
    from kvloom.lora.adapter import LoRAAdapter

    real_load = LoRAAdapter.load
    paths: list[str] = []

    def counting_load(name, path, *args, **kwargs):
        paths.append(path)
        return real_load(name, path, *args, **kwargs)

    monkeypatch.setattr(LoRAAdapter, "load", counting_load)
    llm = LLM(str(models["base"]), dtype="float32", num_blocks=128, enable_lora=True, max_loras=1,
              max_cpu_loras=max_cpu_loras)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    a, b = LoRARequest("a", 1, str(models["a"])), LoRARequest("b", 2, str(models["b"]))
    prompt = [9, 8, 7, 6, 5]
    for lora in (a, b, a):
        output = llm.generate([prompt], params, lora_request=lora)[0].outputs[0]
        check_against_peft(peft_model(models, lora.lora_name), prompt, output)
    assert len(paths) == reads
    assert llm.engine.remove_lora("a")  # unloaded, a name is read again when bound again
    llm.generate([prompt], params, lora_request=a)
    assert len(paths) == reads + 1
    with pytest.raises(ValueError, match=r"max_cpu_loras must be an integer >= max_loras \(2\), got 1"):
        LLM(str(models["base"]), enable_lora=True, max_loras=2, max_cpu_loras=1)
