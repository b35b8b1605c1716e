"""AllenAI's OLMo 2 and OLMo 3: Llama's attention and MLP with the norms after each block
(no input norm), q and k normed over the whole projection, norms scaled in float32; OLMo 3's
windowed layers (three in four) with their own rotary base. Greedy tokens and first
log-probs held to transformers in float32 (chunked, both attention backends, past the
window), bf16 alone equal to batched and chunked; two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched, layer_skip_keeps_greedy_tokens
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(4)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("olmo2"), arch="olmo2", seed=11, **SHAPE)


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers: three of a 12-key window turning the rotary at 10,000, a full one at 1e6."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    return write_tiny_hf_model(tmp_path_factory.mktemp("olmo3"), arch="olmo3", seed=12, num_hidden_layers=4,
                               sliding_window=12, rope_parameters=rope, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_greedy_tokens_and_logprobs_are_transformers(name: str, backend: str, request) -> None:
    path = request.getfixturevalue(name)
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16,
              attention_backend=backend)
    if name == "olmo3":
        layers = llm.engine.model.layers
        assert [layer.self_attn.window for layer in layers] == [12, 12, 12, 0]
        assert [layer.local_rope for layer in layers] == [True, True, True, False]
    for output, prompt in zip(llm.generate(PROMPTS, GREEDY), PROMPTS, strict=True):
        tokens, first = reference_run(path, prompt, GREEDY.max_tokens)
        assert list(output.outputs[0].token_ids) == tokens, prompt
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_bf16_tokens_alone_equal_batched_and_chunked(name: str, request) -> None:
    together = bf16_alone_equals_batched(str(request.getfixturevalue(name)), PROMPTS,
                                         SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert together.model.native_stack is not None  # bf16 on a CPU: the native walk ran OLMo's layers


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_bf16_native_walk_log_probs_are_transformers_float32s(name: str, request) -> None:
    """The walk with no input norm, each block's output normed and added, the q/k norms
    over the whole projection (and OLMo 3's windowed layers' own rotary)."""
    assert_bf16_walk_near_float32(request.getfixturevalue(name), PROMPTS)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_two_ranks_give_transformers_greedy_tokens(name: str, request) -> None:
    """The q/k norms over every head: each rank's sums of squares all-reduced, then its own
    columns scaled by its columns of the weight (in float32, OLMo's order); the walk, which
    would norm a rank's heads alone, leaves those steps to the modules."""
    assert_greedy_is_transformers(request.getfixturevalue(name), PROMPTS[1:3], 6, tensor_parallel_size=2)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_a_gguf_file_gives_transformers_greedy_tokens(name: str, request, tmp_path: Path) -> None:
    """llama.cpp's olmo2 files (OLMo 3's too, its windowed layers listed in
    attention.sliding_window_pattern): no input norm, Q/K rows as HF's."""
    from helpers_models import write_tiny_gguf

    path = request.getfixturevalue(name)
    if name == "olmo3":  # the file holds one rotary base for every layer
        one = {"rope_type": "default", "rope_theta": 10_000.0}
        path = write_tiny_hf_model(tmp_path / "hf", arch="olmo3", seed=13, num_hidden_layers=4, sliding_window=12,
                                   rope_parameters={"sliding_attention": one, "full_attention": one}, **SHAPE)
    llm = LLM(str(write_tiny_gguf(path, tmp_path / f"{name}.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == {"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}[name]
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_layer_skip_drafts_keep_greedy_tokens(olmo3: Path) -> None:
    """OLMo 3's first layers draft for it: the greedy tokens stay the model's."""
    layer_skip_keeps_greedy_tokens(str(olmo3), PROMPTS, 2)
