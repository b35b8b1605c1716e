"""Microsoft's Phi-1/1.5/2 (PhiForCausalLM): attention and MLP side by side on one LayerNorm,
biases everywhere (the output head's too), a partial rotary, optional q/k LayerNorms. Greedy
tokens and first log-probs held to transformers in float32 (chunked, both attention backends,
grouped KV heads, with and without qk_layernorm, from llama.cpp's phi2 GGUF files), bf16 alone
equal to batched and chunked, a layer-skip draft of Phi's own layers; two ranks and an
activation it does not run refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched, layer_skip_keeps_greedy_tokens
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(11)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
# A head of 32 with 12 rotary dimensions; the MLP's width is not llama.cpp's 4 x hidden,
# and the KV heads are grouped, which its phi2 files do not record (read from the tensors).
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             partial_rotary_factor=0.375, layer_norm_eps=1e-5)


@pytest.fixture(scope="module")
def phi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("phi"), arch="phi", seed=21, **SHAPE)


def assert_transformers_tokens(path: Path, **engine: object) -> LLM:
    return assert_greedy_is_transformers(path, PROMPTS, GREEDY.max_tokens, **engine)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(phi: Path, backend: str) -> None:
    llm = assert_transformers_tokens(phi, attention_backend=backend)
    model = llm.engine.model
    assert llm.engine.model_config.rotary_dim == 12
    assert model.lm_head.bias is not None


def test_the_mlp_is_transformers_gelu_new(phi: Path) -> None:
    """On activations of a trained model's size, where GELU's tanh form and the exact one
    part (tiny random weights keep the fc1 outputs where the two agree to 1e-5)."""
    import torch

    from kvloom.config import ModelConfig
    from kvloom.models.layers import UngatedMLP

    reference = transformers.AutoModelForCausalLM.from_pretrained(phi, dtype=torch.float32).model.layers[0].mlp
    config = ModelConfig.from_hf(json.loads((phi / "config.json").read_text()))
    ours = UngatedMLP(config.architecture, config.hidden_size, config.intermediate_size, True, config.hidden_act)
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for module in (reference, ours):
            module.fc1.weight.mul_(40)
            module.fc2.weight.mul_(40)
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
        expected, got = reference(x), ours(x)
        exact = ours.fc2(torch.nn.functional.gelu(ours.fc1(x)))
    assert (exact - expected).abs().max() > 1e-3  # the forms part on these inputs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tied_head_keeps_its_own_bias(tmp_path: Path) -> None:
    """transformers ties the head's weight to the embedding; its bias stays the head's own."""
    path = write_tiny_hf_model(tmp_path / "phi-tied", arch="phi", seed=25, **{**SHAPE, "tie_word_embeddings": True})
    llm = assert_transformers_tokens(path)
    assert llm.engine.model_config.tie_word_embeddings and llm.engine.model.tied_head_bias is not None
    layer_skip_keeps_greedy_tokens(str(path), PROMPTS[1:3], 1)
    # Under two ranks every rank holds the whole bias, added once the logits are gathered.
    assert_greedy_is_transformers(path, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_query_and_key_layernorms_are_transformers(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "phi-qk", arch="phi", seed=22, qk_layernorm=True, **SHAPE)
    llm = assert_transformers_tokens(path)
    assert llm.engine.model.layers[0].self_attn.q_norm.bias is not None  # LayerNorms, with their biases


def test_bf16_tokens_alone_equal_batched_and_chunked(phi: Path) -> None:
    bf16_alone_equals_batched(str(phi), PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


def test_bf16_native_walk_log_probs_are_transformers_float32s(phi: Path) -> None:
    """The walk with attention and MLP side by side on one LayerNorm, a partial rotary, biases."""
    assert_bf16_walk_near_float32(phi, PROMPTS)


def test_its_first_layers_draft_for_it(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "phi4", arch="phi", seed=23, num_hidden_layers=4, **SHAPE)
    layer_skip_keeps_greedy_tokens(str(path), PROMPTS[1:3], 2)


def test_a_gguf_file_gives_transformers_greedy_tokens(phi: Path, tmp_path: Path) -> None:
    """llama.cpp's phi2 files: LayerNorm weights and biases, fc1 / fc2 as ffn_up / ffn_down,
    the output head's bias as output.bias, the rotary's dims as rope.dimension_count."""
    from helpers_models import write_tiny_gguf

    llm = LLM(str(write_tiny_gguf(phi, tmp_path / "phi2.gguf")), dtype="float32", block_size=16, num_blocks=64)
    config = llm.engine.model_config
    assert (config.architecture, config.intermediate_size, config.num_kv_heads) == ("PhiForCausalLM", 256, 2)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(phi, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_two_ranks_give_transformers_greedy_tokens(phi: Path) -> None:
    """The side-by-side blocks each all-reduce before they are added; the head's bias is cut
    with its rows (each rank's share of the vocabulary)."""
    assert_greedy_is_transformers(phi, PROMPTS[1:3], 6, tensor_parallel_size=2)


def test_other_activations_are_refused_by_name(phi: Path, tmp_path: Path) -> None:
    fast = write_tiny_hf_model(tmp_path / "phi-fast", arch="phi", seed=24, hidden_act="gelu_fast", **SHAPE)
    assert json.loads((fast / "config.json").read_text())["hidden_act"] == "gelu_fast"
    with pytest.raises(Exception, match="PhiForCausalLM: hidden_act 'gelu_fast' is not supported"):
        LLM(str(fast), dtype="float32", num_blocks=16)


def test_an_adapter_on_every_projection_is_peft(phi: Path, tmp_path: Path) -> None:
    """Phi's own names: ``dense`` is the o projection, fc1 / fc2 the un-gated MLP's (up and
    down to kvloom's adapters); one on the output head is refused by name."""
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft, write_adapter

    from kvloom import LoRARequest

    assert_adapter_is_peft(phi, tmp_path / "every", PROMPTS[2:], FAMILY_TARGETS["phi"][0])
    head = write_adapter(phi, tmp_path / "head", 2, 4, ["fc1", "lm_head"])
    llm = LLM(str(phi), dtype="float32", block_size=16, num_blocks=64, enable_lora=True)
    either_order = r"\[('fc1', 'lm_head'|'lm_head', 'fc1')\]"  # PEFT writes target_modules from a set
    with pytest.raises(Exception, match=r"target_modules must be a list of \[.*'dense'.*'fc1'.* got " + either_order):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), lora_request=LoRARequest("b", 2, str(head)))
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving
