"""``--hf-overrides`` (vLLM's): config.json keys set over the model's own before it is
read. The override reaches what the engine derives from the config (the context length,
the matryoshka sizes, the rope), a dict merges into the dict it replaces, and the model
then computes as transformers computes the same overridden config."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig, with_hf_overrides
from kvloom.engine.engine import LLMEngine


def test_a_dict_merges_key_by_key_and_other_values_replace() -> None:
    hf = {"rope_scaling": {"type": "yarn", "factor": 2.0}, "max_position_embeddings": 512, "vocab_size": 9}
    merged = with_hf_overrides(hf, {"rope_scaling": {"factor": 4.0}, "max_position_embeddings": 1024,
                                    "is_matryoshka": True})
    assert merged == {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 1024,
                      "vocab_size": 9, "is_matryoshka": True}
    assert hf["rope_scaling"] == {"type": "yarn", "factor": 2.0}  # the original is left alone


def test_the_engine_reads_the_overridden_config(tiny_llama) -> None:
    plain = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=8))
    assert (plain.max_model_len, plain.model_config.is_matryoshka) == (512, False)
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(tiny_llama), dtype="float32", num_blocks=8,
        hf_overrides='{"max_position_embeddings": 128, "matryoshka_dimensions": [16, 32]}'))
    assert engine.max_model_len == 128
    assert (engine.model_config.is_matryoshka, engine.model_config.matryoshka_dimensions) == (True, (16, 32))


def test_an_overridden_rope_computes_as_transformers_with_the_same_override(tiny_llama) -> None:
    import transformers
    override = {"rope_parameters": {"rope_theta": 500.0}}  # merged: the config's rope_type stays
    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 500.0}
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, config=config,
                                                                  dtype=torch.float32).eval()
    prompt = [3, 17, 99, 250, 41, 7, 7, 300, 12, 88, 151, 9, 64, 480, 2, 33]
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=16, hf_overrides=override)
    [output] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    entry = output.outputs[0].logprobs[0]
    for token in expected.topk(5).indices.tolist():
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
    plain = LLM(str(tiny_llama), dtype="float32", num_blocks=16)
    [base] = plain.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    assert base.outputs[0].logprobs[0] != entry  # the override changed the computation


@pytest.mark.parametrize("bad", ["[1]", "{", {"": 1}])
def test_a_bad_override_is_refused_naming_the_option(tiny_llama, bad) -> None:
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineConfig.from_kwargs(str(tiny_llama), hf_overrides=bad)
