"""LiquidAI LFM2 (``Lfm2ForCausalLM``): gated short convolutions (their last inputs a
request's state, in the state slots) between attention layers with per-head q/k norms;
and LFM2-MoE (``Lfm2MoeForCausalLM``), its dense MLPs after the first layers sigmoid-routed
experts.
Greedy tokens and the first log-probs held to transformers in float32 through chunked
prefill on both attention backends, a tied and an untied head; staggered arrivals,
state-slot waits and preemption give transformers' tokens and give every block and slot
back; llama.cpp's lfm2 files give transformers' tokens on the directory they came from;
bf16 alone equals batched; the hub's config.json names (``block_ff_dim``,
``full_attn_idxs``) read as transformers reads them. Prefix-cache hits on it:
test_ssm_prefix_cache.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers
from helpers_ssm import (
    assert_preempted_requests_match_transformers,
    hf_greedy,
    random_prompts,
    ssm_engine,
    write_tiny_ssm_model,
)

from kvloom import SamplingParams
from kvloom.config import ModelConfig

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


# LFM2 with an untied and a tied head; LFM2-MoE (a dense first layer, then sigmoid-routed
# experts steered by a float32 bias).
KINDS = {"untied": ("lfm2", dict(seed=2, tie_word_embeddings=False)), "tied": ("lfm2", dict(seed=2)),
         "moe": ("lfm2_moe", dict(seed=3, tie_word_embeddings=False))}


@pytest.fixture(scope="module", params=sorted(KINDS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = KINDS[request.param]
    return write_tiny_ssm_model(tmp_path_factory.mktemp(f"lfm2-{request.param}"), arch, **overrides)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return random_prompts(6, seed=13)


def test_the_hubs_config_names_are_read_as_transformers_reads_them() -> None:
    """LFM2-350M's config.json (its MLP's width as block_ff_dim, the attention layers as
    full_attn_idxs, no layer_types, the head tied by default) against Lfm2Config's reading."""
    hub = {"architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_ff_dim": 6656,
           "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "conv_L_cache": 3, "conv_bias": False,
           "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 1024, "max_position_embeddings": 128000,
           "norm_eps": 1e-05, "num_attention_heads": 16, "num_hidden_layers": 16, "num_key_value_heads": 8,
           "rope_theta": 1000000.0, "vocab_size": 65536}
    reference = transformers.Lfm2Config(**{k: v for k, v in hub.items() if k != "architectures"})
    config = ModelConfig.from_hf(hub)
    assert config.short_conv is not None and config.ssm is None
    kinds = tuple("attention" if kind == "full_attention" else kind for kind in reference.layer_types)
    assert config.short_conv.layer_kinds == kinds and config.num_kv_layers == 6
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        **{**{k: v for k, v in hub.items() if k != "architectures"}, "num_hidden_layers": 1, "full_attn_idxs": [0],
           "vocab_size": 8}))
    assert config.intermediate_size == model.model.layers[0].feed_forward.w1.out_features == 4608
    assert config.tie_word_embeddings == reference.tie_word_embeddings is True
    assert config.qk_norm and config.rope_theta == 1e6 and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_first_logprobs_are_transformers(model_dir: Path, prompts: dict[str, list[int]],
                                                           backend: str) -> None:
    assert_greedy_is_transformers(model_dir, list(prompts.values())[:4], MAX_TOKENS, attention_backend=backend)


def test_staggered_preempted_and_waiting_requests_match_transformers(model_dir: Path,
                                                                     prompts: dict[str, list[int]]) -> None:
    engine = assert_preempted_requests_match_transformers(model_dir, prompts, MAX_TOKENS)
    assert engine.runner.kv_caches.shape[:3] == (2, 2, 20)  # the two attention layers' K and V


def test_the_moe_routes_as_lfm2_moe_does(model_dir: Path) -> None:
    """Not vacuous: LFM2-MoE's router is read as its own (sigmoid, the bias steering,
    renormalised with its 1e-6 guard) and its bias stays float32 in a bf16 model."""
    import torch

    config = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(model_dir).to_dict())
    if config.architecture != "Lfm2MoeForCausalLM":
        assert config.moe is None and config.intermediate_size == 64
        return
    moe = config.moe
    assert moe is not None and (moe.scoring, moe.topk_method, moe.norm_topk_eps, moe.sparse_layers) == (
        "sigmoid", "noaux_tc", 1e-6, (1, 2, 3))
    assert config.intermediate_size == 48  # the dense layer's width as it is (no LFM2 adjustment)
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=64))
    bias = engine.model.blocks[1].feed_forward.router.score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0


@pytest.mark.parametrize("kind", ["untied", "tied", "moe"])
def test_a_llama_cpp_file_gives_transformers_tokens(kind: str, prompts: dict[str, list[int]],
                                                    tmp_path: Path) -> None:
    """llama.cpp's lfm2 file: head_count_kv per layer, the adjusted MLP width, the short
    convolutions' squeezed weights and the final norm as token_embd_norm; and its lfm2moe file
    (LFM2-MoE): the dense width as it is, the experts stacked, the router and the selection bias,
    the experts' metadata (files that contradict it: tests/models/test_gguf_families.py)."""
    from helpers_models import write_tiny_lfm2_gguf

    from kvloom import LLM

    arch, overrides = KINDS[kind]
    model_dir = write_tiny_ssm_model(tmp_path / "hf", arch, **overrides)

    llm = LLM(str(write_tiny_lfm2_gguf(model_dir, tmp_path / "lfm2.gguf")), dtype="float32", block_size=4,
              num_blocks=256, max_num_batched_tokens=16)
    config = llm.engine.model_config
    if kind == "moe":
        reference_config = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(model_dir).to_dict())
        assert config.architecture == "Lfm2MoeForCausalLM" and config.moe == reference_config.moe
        assert config.intermediate_size == reference_config.intermediate_size == 48
    else:
        assert config.architecture == "Lfm2ForCausalLM" and config.intermediate_size == 64
    assert config.short_conv is not None and config.short_conv.layer_kinds == ("conv", "attention", "conv",
                                                                               "attention")
    outputs = llm.generate(list(prompts.values())[:4], GREEDY)
    reference = hf_greedy(model_dir, dict(list(prompts.items())[:4]), MAX_TOKENS)
    assert [list(output.outputs[0].token_ids) for output in outputs] == list(reference.values())


def test_bf16_tokens_alone_equal_batched_and_chunked(model_dir: Path, prompts: dict[str, list[int]]) -> None:
    bf16_alone_equals_batched(str(model_dir), list(prompts.values()), GREEDY)


def test_refusals_name_the_reason(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative decoding is not supported for state-space models: "
                                         "Lfm2(Moe)?ForCausalLM keeps a state per request in its short-conv layers"):
        ssm_engine(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for state-space"):
        ssm_engine(model_dir, tensor_parallel_size=2)
