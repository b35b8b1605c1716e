"""TII's Falcon: LayerNorms with biases, an un-gated exact-GELU MLP, the embedding as the head,
and its layer kinds: Falcon-7B's (one KV head, attention and MLP side by side on one norm),
the new architecture's (40B / 180B: KV heads grouped, side by side on two norms; Falcon2-11B's
on one), and the blocks in turn with every head's own K and V. Greedy tokens and first log-probs
held to transformers in float32 (q/k/v regrouped from each layout), the native walk in bf16 near
transformers' float32, a LoRA adapter held to PEFT (its query_key_value B regrouped alike);
ALiBi and two ranks refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(37)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, tie_word_embeddings=True)
KINDS = {
    "falcon-7b": dict(multi_query=True, parallel_attn=True, bias=False),
    "new-arch-40b": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    "new-arch-11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "in-turn": dict(multi_query=False, parallel_attn=False, bias=True),
}
# (KV heads, side by side, the norms of a side-by-side layer: read only side by side) of each kind
EXPECTED = {"falcon-7b": (1, True, 1), "new-arch-40b": (2, True, 2), "new-arch-11b": (2, True, 1),
            "in-turn": (4, False, 1)}


@pytest.fixture(scope="module", params=list(KINDS))
def falcon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch="falcon", seed=97, **SHAPE,
                               **KINDS[request.param])


def test_greedy_tokens_and_logprobs_are_transformers(falcon: Path) -> None:
    config = assert_greedy_is_transformers(falcon, PROMPTS, 12).engine.model_config
    kind = falcon.name.rstrip("0123456789")
    assert (config.num_kv_heads, config.parallel_residual, config.parallel_norms) == EXPECTED[kind]


def test_bf16_native_walk_log_probs_are_transformers_float32s(falcon: Path) -> None:
    assert_bf16_walk_near_float32(falcon, PROMPTS)


def test_a_lora_adapter_is_peft(falcon: Path, tmp_path: Path) -> None:
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(falcon, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["falcon"][0])


def test_two_ranks_give_transformers_greedy_tokens_where_the_kv_heads_split(tmp_path: Path) -> None:
    """Falcon-40B's layout (two KV heads, two norms side by side) under two ranks; Falcon-7B's
    one KV head cannot split, refused by name."""
    grouped = write_tiny_hf_model(tmp_path / "falcon-40b", arch="falcon", seed=99, **SHAPE, **KINDS["new-arch-40b"])
    assert_greedy_is_transformers(grouped, PROMPTS[1:3], 6, tensor_parallel_size=2)
    one = write_tiny_hf_model(tmp_path / "falcon-7b", arch="falcon", seed=100, **SHAPE, **KINDS["falcon-7b"])
    with pytest.raises(Exception, match="1 KV heads"):
        LLM(str(one), dtype="float32", num_blocks=16, tensor_parallel_size=2)


def test_alibi_is_refused_by_name(falcon: Path, tmp_path: Path) -> None:
    alibi = write_tiny_hf_model(tmp_path / "falcon-rw", arch="falcon", seed=98, alibi=True, **SHAPE)
    with pytest.raises(Exception, match="Falcon with alibi"):
        LLM(str(alibi), dtype="float32", num_blocks=16)


@pytest.mark.parametrize("kind", ["falcon-7b", "new-arch-40b", "new-arch-11b"])
def test_a_gguf_file_gives_transformers_greedy_tokens(kind: str, tmp_path: Path) -> None:
    """llama.cpp's falcon files (its graph is always side by side): q/k/v regrouped by its
    converter into [q | k | v] and put back in Falcon's KV groups at load; one KV head is
    Falcon-7B's layout, more the new architecture's with one norm or two (attn_norm_2)."""
    from helpers_models import hf_greedy_and_first_logprobs, write_tiny_gguf

    path = write_tiny_hf_model(tmp_path / kind, arch="falcon", seed=104, **SHAPE, **KINDS[kind])
    llm = LLM(str(write_tiny_gguf(path, tmp_path / f"{kind}.gguf")), dtype="float32", block_size=16, num_blocks=64)
    config = llm.engine.model_config
    assert (config.architecture, config.num_kv_heads, config.parallel_norms) == ("FalconForCausalLM",
                                                                                  *EXPECTED[kind][::2])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    for output, prompt in zip(llm.generate(PROMPTS, params), PROMPTS, strict=True):
        tokens, first = hf_greedy_and_first_logprobs(path, prompt, 10)
        assert list(output.outputs[0].token_ids) == tokens
        assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(), abs=1e-4)
