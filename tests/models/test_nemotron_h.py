"""NVIDIA Nemotron-H (``NemotronHForCausalLM``): single-mixer blocks (a Mamba2 mixer, an
attention layer without position encoding, or a squared-ReLU MLP), norms scaled in
float32; and Nemotron 3's MoE blocks (squared-ReLU experts without a gate, routed as
DeepSeek-V3 routes, beside a shared expert). Greedy tokens and the first log-probs held to
transformers in float32 through chunked prefill on both attention backends; staggered
arrivals, state-slot waits and preemption give transformers' tokens and give every block and
slot back; bf16 alone equals batched; the hub's hybrid_override_pattern read as transformers
reads it, a latent MoE projection (Nemotron 3 Super's) refused by name. Prefix-cache hits on
it: test_ssm_prefix_cache.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers
from helpers_ssm import assert_preempted_requests_match_transformers, random_prompts, ssm_engine, write_tiny_ssm_model

from kvloom import SamplingParams
from kvloom.config import ModelConfig

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Nemotron-H's dense blocks; Nemotron 3's MoE blocks among them (helpers_ssm's nemotron_h_moe)."""
    arch = "nemotron_h" if request.param == "dense" else "nemotron_h_moe"
    return write_tiny_ssm_model(tmp_path_factory.mktemp(f"nemotron-h-{request.param}"), arch, seed=2)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return random_prompts(6, seed=17)


def test_the_hubs_pattern_is_read_as_transformers_reads_it() -> None:
    """Nemotron-H-8B's form of config.json: the blocks as hybrid_override_pattern letters."""
    hub = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-M-", "num_hidden_layers": 7,
           "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
           "conv_kernel": 4, "chunk_size": 32, "layer_norm_epsilon": 1e-5, "vocab_size": 128}
    reference = transformers.NemotronHConfig(**{k: v for k, v in hub.items() if k != "architectures"})
    config = ModelConfig.from_hf(hub)
    names = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
    assert config.ssm is not None and config.ssm.layer_kinds == tuple(names[k] for k in reference.layers_block_type)
    assert config.num_kv_layers == 1 and config.no_rope_layers == tuple(range(7)) and config.hidden_act == "relu2"
    assert config.moe is None
    # Nemotron 3's MoE blocks ("E"), its router's and experts' keys as transformers reads them.
    experts = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "n_group": 2,
               "topk_group": 1, "moe_shared_expert_intermediate_size": 40, "routed_scaling_factor": 2.5}
    moe_hub = {**hub, "hybrid_override_pattern": "M-M*-ME", **experts}
    reference = transformers.NemotronHConfig(**{k: v for k, v in moe_hub.items() if k != "architectures"})
    config = ModelConfig.from_hf(moe_hub)
    assert config.ssm is not None and config.ssm.layer_kinds[-1] == "moe" == reference.layers_block_type[-1]
    moe = config.moe
    assert moe is not None and moe.sparse_layers == (6,) and not moe.gated and moe.hidden_act == "relu2"
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (
        reference.n_routed_experts, reference.num_experts_per_tok, reference.moe_intermediate_size,
        reference.moe_shared_expert_intermediate_size)
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.topk_groups, moe.routed_scaling_factor,
            moe.norm_topk_eps, moe.router_float32) == ("sigmoid", "noaux_tc", 2, 1, 2.5, 1e-20, True)
    with pytest.raises(ValueError, match="latent MoE projection .moe_latent_size 16. is not supported"):
        ModelConfig.from_hf({**moe_hub, "moe_latent_size": 16})


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_greedy_tokens_and_first_logprobs_are_transformers(model_dir: Path, prompts: dict[str, list[int]],
                                                           backend: str) -> None:
    assert_greedy_is_transformers(model_dir, list(prompts.values())[:4], MAX_TOKENS, attention_backend=backend)


def test_staggered_preempted_and_waiting_requests_match_transformers(model_dir: Path,
                                                                     prompts: dict[str, list[int]]) -> None:
    engine = assert_preempted_requests_match_transformers(model_dir, prompts, MAX_TOKENS)
    assert engine.runner.kv_caches.shape[:3] == (1, 2, 20)  # the one attention layer's K and V


def test_the_moe_blocks_experts_are_theirs(model_dir: Path) -> None:
    """Not vacuous: the MoE blocks hold experts of up alone and a shared expert of up and down,
    their router's bias float32 and not zero in a bf16 model; in bf16 on a CPU the router's
    logits and top-k are kvloom's kernels (native_logits, native_route), as the native walk's
    (tests/models/test_decoder_stack.py holds the walk to the modules on this model)."""
    import torch

    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.models.moe import SparseMoE

    engine = LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", num_blocks=64))
    model = engine.model
    moe = [block.mixer for block in model.blocks if block.kind == "moe"]  # type: ignore[attr-defined]
    assert model.native_stack is not None  # type: ignore[attr-defined]
    if not moe:
        return
    assert len(moe) == 3 and all(isinstance(layer, SparseMoE) for layer in moe)
    router = moe[0].router
    assert router.native_logits and router.native_route and router.weight.dtype == torch.float32
    assert router.score_correction_bias is not None and router.score_correction_bias.abs().sum() > 0
    assert moe[0].grouped is not None and moe[0].grouped.gate_up_features == 24  # up alone
    assert model.native_stack is not None  # type: ignore[attr-defined]


def test_bf16_tokens_alone_equal_batched_and_chunked(model_dir: Path, prompts: dict[str, list[int]]) -> None:
    bf16_alone_equals_batched(str(model_dir), list(prompts.values()), GREEDY)


def test_refusals_name_the_reason(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for state-space"):
        ssm_engine(model_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("form", ["untied", "tied", "moe"])
def test_a_llama_cpp_file_gives_transformers_tokens(prompts: dict[str, list[int]], form: str,
                                                    tmp_path: Path) -> None:
    """llama.cpp's nemotron_h file (NemotronHModel on GraniteHybridModel): the block kinds from
    the per-block head_count_kv and feed_forward_length, the mixers stored as Mamba2's, the
    attention's q/k rows permuted, no rope. ``tied``: config.json says tie_word_embeddings,
    which transformers ignores for Nemotron-H (its lm_head is its own): the HF directory and
    the file alike give transformers' tokens. ``moe``: Nemotron 3's nemotron_h_moe file (one
    group of experts, as Nemotron 3 Nano's: the converter records no groups used), the MoE
    blocks those with a feed_forward_length, their sizes and routing from the expert_* keys,
    every expert's up and down stacked."""
    import torch
    from helpers_models import hf_greedy_tokens, write_tiny_nemotron_h_gguf

    from kvloom import LLM

    blocks = (["mamba", "moe", "attention", "moe", "mamba"] if form == "moe"
              else ["mlp", "mamba", "attention", "mlp", "mamba"])
    model_dir = write_tiny_ssm_model(tmp_path / "hf", "nemotron_h_moe" if form == "moe" else "nemotron_h", seed=4,
                                     tie_word_embeddings=form == "tied", layers_block_type=blocks,
                                     **({"n_group": 1} if form == "moe" else {}))
    llm = LLM(str(write_tiny_nemotron_h_gguf(model_dir, tmp_path / "nemotron_h.gguf")), dtype="float32",
              block_size=4, num_blocks=256, max_num_batched_tokens=16)
    config = llm.engine.model_config
    assert config.architecture == "NemotronHForCausalLM" and not config.tie_word_embeddings
    assert config.ssm is not None and config.ssm.layer_kinds == tuple(blocks)
    if form == "moe":
        reference = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(model_dir).to_dict())
        assert config.moe == reference.moe and config.moe is not None and not config.moe.gated
    chosen = list(prompts.values())[:4]
    outputs = llm.generate(chosen, GREEDY)
    # transformers' generate cannot start its cache at an MLP block: each step recomputed whole.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_cache=False).eval()
    expected = [hf_greedy_tokens(model, prompt, MAX_TOKENS) for prompt in chosen]
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
    from_directory = LLM(str(model_dir), dtype="float32", block_size=4, num_blocks=256).generate(chosen, GREEDY)
    assert [list(output.outputs[0].token_ids) for output in from_directory] == expected
