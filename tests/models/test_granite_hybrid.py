"""IBM Granite 4.0 (``GraniteMoeHybridForCausalLM``): Bamba's stack of Mamba2 mixers and
attention layers with Granite's four multipliers, as its published models have it (no
rotary, no experts: the shared MLP as each layer's dense MLP) and with routed experts
beside the shared MLP and rotary over the whole head. Greedy tokens and the first
log-probs held to transformers in float32 through chunked prefill on both attention
backends; staggered arrivals, state-slot waits and preemption give transformers' tokens
and give every block and slot back; llama.cpp's granitehybrid files of both kinds give
transformers' tokens on the HF directory they were converted from; bf16 alone equals
batched. Prefix-cache hits on it: test_ssm_prefix_cache.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers, write_tiny_gguf_family
from helpers_ssm import (
    assert_preempted_requests_match_transformers,
    hf_greedy,
    random_prompts,
    ssm_engine,
    write_tiny_ssm_model,
)

from kvloom import LLM, SamplingParams

pytest.importorskip("transformers")

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Granite 4.0's published form (granite-4.0-h-micro, -h-1b, -h-350m): no rotary, no experts, a
# tied head; and the MoE form (granite-4.0-h-tiny, -h-small) here with rotary, which none publishes.
KINDS = {"dense_nope": dict(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=True, seed=1),
         "moe_rope": {}}


@pytest.fixture(scope="module", params=sorted(KINDS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_ssm_model(tmp_path_factory.mktemp(f"granite4-{request.param}"), "granite_hybrid",
                                **KINDS[request.param])


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return random_prompts(6, seed=11)


def test_the_model_is_what_its_config_says(model_dir: Path) -> None:
    """Not vacuous: the multipliers, the layer kinds, the FFN and the rotary are read."""
    engine = ssm_engine(model_dir, num_blocks=64)
    config = engine.model_config
    assert config.scales is not None and (config.scales.embedding, config.scales.residual, config.scales.attention,
                                          config.scales.logits) == (3.0, 0.5, 0.2, 2.0)
    assert config.ssm is not None and config.ssm.layer_kinds == ("mamba", "attention", "mamba", "attention")
    model = engine.model
    if config.moe is None:  # the shared MLP's width is the dense MLP's
        assert config.intermediate_size == 40 and config.no_rope_layers == (0, 1, 2, 3) and model.rotary is None
    else:
        assert (config.moe.num_experts, config.moe.shared_expert_intermediate_size) == (4, 40)
        assert config.no_rope_layers == () and model.rotary is not None
    assert engine.runner.kv_caches.shape[0] == 2  # the two attention layers


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_first_logprobs_are_transformers(model_dir: Path, prompts: dict[str, list[int]],
                                                           backend: str) -> None:
    assert_greedy_is_transformers(model_dir, list(prompts.values())[:4], MAX_TOKENS, attention_backend=backend)


def test_staggered_preempted_and_waiting_requests_match_transformers(model_dir: Path,
                                                                     prompts: dict[str, list[int]]) -> None:
    assert_preempted_requests_match_transformers(model_dir, prompts, MAX_TOKENS)


def test_a_llama_cpp_file_gives_transformers_tokens(model_dir: Path, prompts: dict[str, list[int]],
                                                    tmp_path: Path) -> None:
    """llama.cpp's granitehybrid file: the multipliers as its keys, the experts and the shared
    MLP split into its tensors, no rope whatever the config says (its converter's rule), so the
    file of the rotary model is compared with that model run without its rotary."""
    import json
    import shutil

    source = model_dir
    if json.loads((model_dir / "config.json").read_text()).get("position_embedding_type") == "rope":
        source = tmp_path / "nope"
        shutil.copytree(model_dir, source)
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "position_embedding_type": None}))
    gguf_file = write_tiny_gguf_family(source, tmp_path / "granite4.gguf")
    llm = LLM(str(gguf_file), dtype="float32", block_size=4, num_blocks=256, max_num_batched_tokens=16)
    assert llm.engine.model_config.architecture == "GraniteMoeHybridForCausalLM"
    outputs = llm.generate(list(prompts.values())[:4], GREEDY)
    reference = hf_greedy(source, dict(list(prompts.items())[:4]), MAX_TOKENS)
    assert [list(output.outputs[0].token_ids) for output in outputs] == list(reference.values())


def test_bf16_tokens_alone_equal_batched_and_chunked(model_dir: Path, prompts: dict[str, list[int]]) -> None:
    bf16_alone_equals_batched(str(model_dir), list(prompts.values()), GREEDY)


def test_refusals_name_the_reason(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for state-space"):
        ssm_engine(model_dir, tensor_parallel_size=2)
