"""Google's Gemma, Gemma 2 and Gemma 3 (text): Llama's attention with norms by
(1 + weight), a sqrt(hidden)-scaled embedding, GeGLU; for Gemma 2 and 3 the sandwich
norms, query_pre_attn_scalar and sliding-window layers beside full ones; Gemma 2's
attention and logit softcaps; Gemma 3's q/k head norms and its windowed layers' own rotary
base (five to one full layer), and a final logit softcap where config.json sets one.
Greedy tokens and first log-probs held to transformers in float32 (chunked, both
attention backends, contexts past the window); bf16, which runs the native walk, near
float32's first log-probs and alone equal to batched and chunked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched, layer_skip_keeps_greedy_tokens
from helpers_models import assert_bf16_walk_near_float32, write_tiny_hf_model
from helpers_models import hf_greedy_and_first_logprobs as reference_run

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(3)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("gemma"), arch="gemma", seed=7, **SHAPE)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six layers: five of a 12-key window (rotary base 10,000) and a full one (1e6); a
    query_pre_attn_scalar that is not head_dim and a final softcap small enough to move
    the tokens, so that none of them can be missed."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3", seed=8, num_hidden_layers=6,
                               sliding_window=12, query_pre_attn_scalar=19, final_logit_softcapping=2.0,
                               rope_theta=1_000_000.0, **SHAPE)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Windowed and full layers in turn (a 12-key window), and caps low enough that most
    attention scores and logits bend (Gemma 2's own are 50 and 30)."""
    return write_tiny_hf_model(tmp_path_factory.mktemp("gemma2"), arch="gemma2", seed=9, num_hidden_layers=4,
                               sliding_window=12, query_pre_attn_scalar=19, attn_logit_softcapping=0.5,
                               final_logit_softcapping=2.0, **SHAPE)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_greedy_tokens_and_logprobs_are_transformers(name: str, backend: str, request) -> None:
    path = request.getfixturevalue(name)
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16,
              attention_backend=backend)
    model = llm.engine.model
    if name == "gemma3":
        assert [layer.self_attn.window for layer in model.layers] == [12] * 5 + [0]
        assert [layer.local_rope for layer in model.layers] == [True] * 5 + [False]
    if name == "gemma2":
        assert [layer.self_attn.window for layer in model.layers] == [12, 0, 12, 0]
        assert llm.engine.runner.backend.softcap == 0.5
    for output, prompt in zip(llm.generate(PROMPTS, GREEDY), PROMPTS, strict=True):
        tokens, first = reference_run(path, prompt, GREEDY.max_tokens)
        assert list(output.outputs[0].token_ids) == tokens, prompt
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_bf16_native_walk_log_probs_are_transformers_float32s(name: str, request) -> None:
    """The walk with Gemma's norms, GeGLU, block norms, softcap and local rotary."""
    assert_bf16_walk_near_float32(request.getfixturevalue(name), PROMPTS)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_bf16_tokens_alone_equal_batched_and_chunked(name: str, request) -> None:
    together = bf16_alone_equals_batched(str(request.getfixturevalue(name)), PROMPTS,
                                         SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert together.model.native_stack is not None  # bf16 on CPU: the native walk ran Gemma's layers


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_a_gguf_file_gives_transformers_greedy_tokens(name: str, request, tmp_path: Path) -> None:
    """llama.cpp's gemma, gemma2 and gemma3 files: norms stored as 1 + weight, no output
    head, Q/K rows as HF's; the layer pattern, Gemma 3's local rotary base and the attention
    scale as llama.cpp takes them (the files do not record them)."""
    from helpers_models import write_tiny_gguf

    path = request.getfixturevalue(name)
    if name != "gemma":  # llama.cpp scales attention by head_dim ** -0.5: the file cannot hold 19
        import json
        config = json.loads((path / "config.json").read_text())
        path = write_tiny_hf_model(tmp_path / "hf", arch=name, seed=10, **{
            key: config[key] for key in ("num_hidden_layers", "sliding_window", "final_logit_softcapping",
                                         "attn_logit_softcapping") if key in config}, query_pre_attn_scalar=32,
            **SHAPE)
    llm = LLM(str(write_tiny_gguf(path, tmp_path / f"{name}.gguf")), dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.model_config.architecture == {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                                    "gemma3": "Gemma3ForCausalLM"}[name]
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [reference_run(path, p, GREEDY.max_tokens)[0]
                                                               for p in PROMPTS]


def test_layer_skip_drafts_keep_greedy_tokens(gemma3: Path) -> None:
    """Gemma 3's first layers (its own layers and forward, the windowed layers' rotary)
    draft for it: the greedy tokens stay the model's."""
    layer_skip_keeps_greedy_tokens(str(gemma3), PROMPTS, 3)
