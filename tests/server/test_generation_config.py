"""--generation-config: generation_config.json's sampling defaults apply to the fields a
request leaves unset ('auto' reads the model's, 'none'/'vllm' ignore it, a directory
reads that one's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvloom.config import EngineConfig
from kvloom.engine.admission import AdmissionLimits
from kvloom.generation_config import generation_defaults
from kvloom.server.generation import base_params, engine_requests
from kvloom.server.protocol import CompletionRequest
from kvloom.server.settings import ServerSettings
from kvloom.server.streams import ModelInfo

# As Hugging Face writes it: token ids and do_sample are not sampling defaults we take.
HF_FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
           "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "transformers_version": "4.40.0"}
TAKEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}


def _with_file(directory: Path, content: object = HF_FILE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(content))
    return directory


def test_auto_reads_the_models_file_and_only_its_sampling_keys(tmp_path) -> None:
    assert generation_defaults("auto", _with_file(tmp_path / "m")) == TAKEN
    assert generation_defaults("auto", tmp_path / "empty-dir") == {}
    assert generation_defaults("auto", tmp_path / "model.gguf") == {}  # a file: none


@pytest.mark.parametrize("setting", ["none", "vllm"])
def test_none_and_vllm_ignore_it(tmp_path, setting: str) -> None:
    assert generation_defaults(setting, _with_file(tmp_path / "m")) == {}


def test_a_directory_reads_that_ones(tmp_path) -> None:
    other = _with_file(tmp_path / "other", {"temperature": 0.3, "repetition_penalty": 1.1})
    assert generation_defaults(str(other), _with_file(tmp_path / "m")) == {
        "temperature": 0.3, "repetition_penalty": 1.1}


def test_a_bad_setting_names_the_field_before_loading(tmp_path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm', 'none' or a "
                                         "directory holding generation_config.json"):
        EngineConfig(generation_config=str(tmp_path / "missing"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        generation_defaults(str(tmp_path / "broken"), None)


def test_the_engine_reads_auto_from_its_model_dir(tiny_llama, tmp_path) -> None:
    from kvloom.engine.engine import LLMEngine
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    _with_file(model)
    engine = LLMEngine(EngineConfig.from_kwargs(str(model), dtype="float32", num_blocks=8))
    assert engine.generation_defaults == TAKEN
    engine = LLMEngine(EngineConfig.from_kwargs(str(model), dtype="float32", num_blocks=8,
                                                generation_config="none"))
    assert engine.generation_defaults == {}


def _info(defaults: dict) -> ModelInfo:
    return ModelInfo("m", AdmissionLimits(max_model_len=64, vocab_size=100, num_blocks=16, block_size=16),
                     tokenizer=None, generation_defaults=defaults)


def test_the_defaults_fill_what_a_request_leaves_unset() -> None:
    info = _info(TAKEN)
    params = base_params(CompletionRequest(prompt=[1, 2]), ServerSettings(), None, info)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    [request] = engine_requests("r", [[1, 2]], params, None, info, 0, "prompt")
    assert request.params.max_tokens == 7
    # What the request sets wins.
    body = CompletionRequest(prompt=[1, 2], temperature=0.0, top_k=5, max_tokens=3)
    params = base_params(body, ServerSettings(), None, info)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 5)
    [request] = engine_requests("r", [[1, 2]], params, body.max_tokens, info, 0, "prompt")
    assert request.params.max_tokens == 3


def test_without_defaults_the_request_is_unchanged() -> None:
    plain = base_params(CompletionRequest(prompt=[1, 2]), ServerSettings(), None, _info({}))
    assert plain == base_params(CompletionRequest(prompt=[1, 2]), ServerSettings(), None)


def test_llm_generate_without_params_uses_the_defaults(tiny_llama, tmp_path) -> None:
    from kvloom.engine.llm import LLM
    from kvloom.sampling_params import SamplingParams
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    _with_file(model, {"max_new_tokens": 3, "temperature": 0.0})
    llm = LLM(str(model), dtype="float32", num_blocks=8)
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3, temperature=0.0)
    [output] = llm.generate([1, 2, 3])
    assert (len(output.outputs[0].token_ids), output.outputs[0].finish_reason) == (3, "length")
    assert LLM(str(tiny_llama), dtype="float32", num_blocks=8).get_default_sampling_params() == SamplingParams()


def test_an_override_sets_its_keys_over_the_files(tiny_llama, tmp_path) -> None:
    """vLLM's --override-generation-config: its keys over the file's ('auto'), alone with
    'vllm'; a key that is not a sampling default, or a value SamplingParams refuses, is
    refused before loading, naming it."""
    from kvloom.engine.llm import LLM
    from kvloom.sampling_params import SamplingParams
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    _with_file(model)
    override = {"temperature": 0.0, "max_new_tokens": 4}
    llm = LLM(str(model), dtype="float32", num_blocks=8, override_generation_config=json.dumps(override))
    assert llm.engine.generation_defaults == {**TAKEN, "temperature": 0.0, "max_tokens": 4}
    [output] = llm.generate([1, 2, 3])
    assert (len(output.outputs[0].token_ids), output.outputs[0].finish_reason) == (4, "length")
    alone = LLM(str(model), dtype="float32", num_blocks=8, generation_config="vllm",
                override_generation_config=override)
    assert alone.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=4)
    for bad, message in (({"do_sample": True}, r"keys \['do_sample'\] that are not sampling defaults"),
                         ({"top_p": 0}, "override_generation_config: top_p must be in"),
                         ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs(str(model), override_generation_config=bad)
