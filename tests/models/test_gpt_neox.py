"""EleutherAI's GPT-NeoX (Pythia): two LayerNorms a layer, a parallel residual (or not), q/k/v
fused per head, a partial rotary, an exact-GELU MLP. Greedy tokens and first log-probs held to
transformers in float32 (chunked, both attention backends, both residual forms, from llama.cpp's
gptneox GGUF files, with old checkpoints' saved buffers beside the weights), bf16 alone equal to
batched and chunked; two ranks refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(12)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
# Heads of 32 with 8 rotary dimensions (Pythia's rotary_pct 0.25).
SHAPE = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, rotary_pct=0.25, layer_norm_eps=1e-5)


@pytest.fixture(scope="module")
def neox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("neox"), arch="gpt_neox", seed=31, **SHAPE)


def assert_transformers_tokens(path: Path, **engine: object) -> LLM:
    return assert_greedy_is_transformers(path, PROMPTS, GREEDY.max_tokens, **engine)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(neox: Path, backend: str) -> None:
    llm = assert_transformers_tokens(neox, attention_backend=backend)
    config = llm.engine.model_config
    assert (config.rotary_dim, config.parallel_residual, config.hidden_act) == (8, True, "gelu")


def test_the_sequential_residual_is_transformers(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "neox-seq", arch="gpt_neox", seed=32, use_parallel_residual=False, **SHAPE)
    assert not assert_transformers_tokens(path).engine.model_config.parallel_residual


def test_the_mlp_is_transformers_exact_gelu(neox: Path) -> None:
    """On activations of a trained model's size, where GELU's exact form and the tanh one part."""
    from kvloom.config import ModelConfig
    from kvloom.models.layers import UngatedMLP

    reference = transformers.AutoModelForCausalLM.from_pretrained(neox, dtype=torch.float32).gpt_neox.layers[0].mlp
    config = ModelConfig.from_hf(json.loads((neox / "config.json").read_text()))
    ours = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, True, config.hidden_act)
    ours.load_state_dict({"fc1.weight": reference.dense_h_to_4h.weight, "fc1.bias": reference.dense_h_to_4h.bias,
                          "fc2.weight": reference.dense_4h_to_h.weight, "fc2.bias": reference.dense_4h_to_h.bias})
    with torch.no_grad():
        for weight in (reference.dense_h_to_4h.weight, reference.dense_4h_to_h.weight, ours.fc1.weight,
                       ours.fc2.weight):
            weight.mul_(40)
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
        expected, got = reference(x), ours(x)
        tanh_form = ours.fc2(torch.nn.functional.gelu(ours.fc1(x), approximate="tanh"))
    assert (tanh_form - expected).abs().max() > 1e-3  # the forms part on these inputs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_tokens_alone_equal_batched_and_chunked(neox: Path) -> None:
    bf16_alone_equals_batched(str(neox), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_bf16_native_walk_log_probs_are_transformers_float32s(neox: Path) -> None:
    """The walk with attention and MLP side by side on two LayerNorms, GELU's exact form."""
    assert_bf16_walk_near_float32(neox, PROMPTS)


def test_saved_buffers_beside_the_weights_are_skipped(neox: Path, tmp_path: Path) -> None:
    """Older conversions saved the causal mask and the rotary's frequencies with the weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(neox, tmp_path / "neox-buffers"))
    state = load_file(str(copy / "model.safetensors"))
    state["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    state["gpt_neox.layers.1.attention.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    outputs = LLM(str(copy), dtype="float32", num_blocks=64).generate(PROMPTS[1:3], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(neox, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS[1:3]]


def test_a_gguf_file_gives_transformers_greedy_tokens(neox: Path, tmp_path: Path) -> None:
    """llama.cpp's gptneox files: q/k/v regrouped [q | k | v] by its converter (put back per
    head), LayerNorm weights and biases, the rotary's dims and the residual form as metadata."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(neox, tmp_path / "neox.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == "GPTNeoXForCausalLM"
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(neox, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_two_ranks_give_transformers_greedy_tokens(neox: Path) -> None:
    """query_key_value regrouped into [q | k | v] whole, then each rank's heads of each part."""
    assert_greedy_is_transformers(neox, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_an_adapter_on_every_projection_is_peft(neox: Path, tmp_path: Path) -> None:
    """query_key_value holds q, k and v head by head: its B's rows are put in kvloom's
    [q | k | v] order as the weight's are; dense_h_to_4h / dense_4h_to_h are the un-gated MLP."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(neox, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["gpt_neox"][0])
