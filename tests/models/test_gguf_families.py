"""GGUF files of the new families (issue 22), converted from tiny random-weight HF
checkpoints the way llama.cpp's converter writes them (helpers_models.write_tiny_gguf_family):
DeepSeek-V2 (dense only; MoE with q-LoRA, group-limited routing and an older converter's
whole kv_b), DeepSeek-V3, Mixtral (experts stacked, and one tensor per expert as files from
before April 2024 have them), Qwen2-MoE and Qwen3-MoE (a dense layer among sparse ones), Mamba2 and
Bamba (granitehybrid: mixers and attention layers interleaved), GPT-OSS (gate and up split
into two expert tensors, their biases too).
Each loads with every HF tensor back under its hub name (Mamba2's and Bamba's A, stored
as -exp(A_log), bit for bit), the engine's config of it equals the HF directory's, and the
engine's greedy tokens on it equal transformers' float32 tokens on the HF directory.
Files that contradict their family are refused with the reason; IBM Granite 4.0's
granitehybrid files (GraniteMoeHybrid) are told from Bamba's by what only they have
(tests/models/test_granite_hybrid.py serves them)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers_models import hf_greedy_tokens, write_tiny_gguf_family, write_tiny_hf_model
from helpers_ssm import write_tiny_ssm_model

from kvloom import LLM, SamplingParams
from kvloom.config import ModelConfig
from kvloom.models import gguf_loader
from kvloom.models.errors import ModelLoadError
from kvloom.models.loader import load_checkpoint
from kvloom.paths import kvloom_home

MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1)
# case -> (HF model_type, config overrides, converter options, GGUF tensors that show the file is llama.cpp's)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "deepseek-v2-dense": ("deepseek_v2", dict(MLA, first_k_dense_replace=2, q_lora_rank=None), {},
                          ("blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight", "blk.1.ffn_gate.weight")),
    "deepseek-v2-moe-whole-kv-b": ("deepseek_v2", dict(MLA, q_lora_rank=24, topk_method="group_limited_greedy",
                                                       n_group=2, topk_group=1, routed_scaling_factor=1.5),
                                   {"split_kv_b": False}, ("blk.0.attn_kv_b.weight", "blk.1.ffn_gate_exps.weight")),
    "deepseek-v3": ("deepseek_v3", dict(MLA, q_lora_rank=None, n_group=2, topk_group=1), {},
                    ("blk.1.exp_probs_b.bias", "blk.1.ffn_down_exps.weight", "blk.1.ffn_up_shexp.weight")),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), {},
                ("blk.0.ffn_gate_inp.weight", "blk.1.ffn_up_exps.weight")),
    "mixtral-per-expert": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), {"stack_experts": False},
                           ("blk.0.ffn_gate.0.weight", "blk.1.ffn_down.3.weight")),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[1]), {},
                  ("blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate.weight")),
    # llama.cpp's qwen3moe always renormalises the top-k weights: so does this model.
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                    mlp_only_layers=[1], norm_topk_prob=True), {},
                  ("blk.0.attn_q_norm.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate.weight")),
    # Windowed (4 keys) and full layers alternating, sinks, biased router and experts, YaRN.
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                                max_position_embeddings=4096), {},
                ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.1.ffn_up_exps.bias",
                 "blk.1.ffn_down_exps.weight", "blk.0.post_attention_norm.weight")),
    # The SSD chunk size is not in GGUF: the loader takes HF's default, so the model has it too.
    "mamba2": ("mamba2", dict(chunk_size=256), {}, ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.1.ssm_conv1d.weight")),
    # Mixers in layers 0 and 2, attention in 1 and 3 (the last layer attends).
    "bamba": ("bamba", dict(num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_chunk_size=256), {},
              ("blk.0.ssm_a", "blk.2.ssm_norm.weight", "blk.1.attn_q.weight", "blk.3.attn_k.weight",
               "blk.1.ffn_norm.weight", "output_norm.weight")),
}
SSM_TYPES = ("mamba2", "bamba")  # written by helpers_ssm


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """case -> (HF directory, its GGUF), each written once per module."""
    root = tmp_path_factory.mktemp("gguf-families")
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            model_type, overrides, options, _ = CASES[case]
            hf_dir = (write_tiny_ssm_model(root / case, model_type, **overrides) if model_type in SSM_TYPES
                      else write_tiny_hf_model(root / case, model_type, **overrides))
            made[case] = hf_dir, write_tiny_gguf_family(hf_dir, root / f"{case}.gguf", **options)
        return made[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensors_and_config_are_the_hf_checkpoints(case: str, converted: Callable[[str], tuple[Path, Path]],
                                                   tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf_dir, gguf_file = converted(case)
    reader = gguf_loader.open_gguf(gguf_file)
    stored = {t.name for t in reader.tensors}
    assert set(CASES[case][3]) <= stored  # not a vacuous round trip: llama.cpp's layout
    checkpoint = load_checkpoint(str(gguf_file), home=tmp_path, cache_gguf=False)
    ours = dict(checkpoint.weights())
    expected = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(ours) == sorted(expected)
    assert gguf_loader.num_weights(reader) == len(ours)
    for name, tensor in expected.items():
        if name.endswith(".A_log"):  # only -exp(A_log) is stored: the A the model computes is the same
            assert torch.equal(torch.exp(ours[name]), torch.exp(tensor)), name
        else:
            assert torch.equal(ours[name], tensor), name
    assert ModelConfig.from_hf(checkpoint.hf_config) == ModelConfig.from_hf(load_checkpoint(str(hf_dir)).hf_config)


def test_bamba_file_is_llama_cpp_layout(converted: Callable[[str], tuple[Path, Path]]) -> None:
    """Not a vacuous round trip: the file says which layers attend the way the converter
    does (head_count_kv 0 in a mixer), and its Q/K rows are in llama.cpp's order."""
    from safetensors.torch import load_file

    hf_dir, gguf_file = converted("bamba")
    reader = gguf_loader.open_gguf(gguf_file)
    assert reader.fields["granitehybrid.attention.head_count_kv"].contents() == [0, 2, 0, 2]
    assert reader.fields["granitehybrid.rope.scaling.finetuned"].contents() is True
    hf = load_file(str(hf_dir / "model.safetensors"))
    stored = {t.name: gguf_loader.dequantize(t) for t in reader.tensors}
    for part, proj, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        original = hf[f"model.layers.3.self_attn.{proj}.weight"].numpy()
        assert np.array_equal(stored[f"blk.3.{part}.weight"], gguf_loader.permute_rows(original, heads))
        assert not np.array_equal(stored[f"blk.3.{part}.weight"], original)
    ssm = ModelConfig.from_hf(gguf_loader.gguf_hf_config(reader, gguf_file)).ssm
    assert ssm is not None and ssm.layer_kinds == ("mamba", "attention", "mamba", "attention")



@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $KVLOOM_HOME for the engine's dequantized GGUF cache that shares the
    built kernels of the usual one (rebuilding them takes seconds)."""
    kernels = kvloom_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(case: str, converted: Callable[[str], tuple[Path, Path]],
                                          home: Path) -> None:
    import transformers

    hf_dir, gguf_file = converted(case)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rng = random.Random(case)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 23)]
    # A small token budget splits the longest prompt into chunks; all run batched.
    llm = LLM(str(gguf_file), dtype="float32", block_size=16, num_blocks=32, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy_tokens(reference, prompt, 6), f"prompt of {len(prompt)} tokens"
    assert list((home / "gguf-cache").glob("*/model.safetensors"))  # the engine read the dequantized cache


# ------------------------------------------------------------------ refusals
def _gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> Path:
    """A sketch of a file: ``<arch>.<key>`` integers, floats, strings, booleans and arrays,
    zero tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string, bool: writer.add_bool,
               list: writer.add_array}[type(value)]
        add(f"{arch}.{key}", value)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BASE = {"block_count": 2, "embedding_length": 8, "attention.head_count": 2, "feed_forward_length": 8}
LATENT = dict(BASE, **{"attention.kv_lora_rank": 4, "rope.dimension_count": 2, "attention.key_length_mla": 6,
                       "attention.value_length_mla": 4})
LATENT_TENSORS = {"token_embd.weight": (16, 8), "blk.0.attn_q.weight": (12, 8), "blk.0.attn_output.weight": (8, 8)}
ROUTER_1 = {"blk.1.ffn_gate_inp.weight": (2, 8)}
# A Bamba-shaped granitehybrid file (4 heads of 2, attention in layer 1 of 2), as the
# converter writes it; Granite 4.0's differ from it by the keys and tensors below.
HYBRID = dict(BASE, **{"attention.head_count": 4, "attention.head_count_kv": [0, 2], "context_length": 64,
                       "rope.dimension_count": 2, "rope.scaling.finetuned": True, "ssm.inner_size": 16,
                       "ssm.time_step_rank": 2, "ssm.state_size": 4, "ssm.group_count": 1, "ssm.conv_kernel": 4})
HYBRID_TENSORS = {"token_embd.weight": (16, 8)}
# A Nemotron-H-shaped file: a mixer, attention and an MLP block (head_count_kv and
# feed_forward_length per block, as NemotronHModel writes them).
NEMOTRON_H = dict(HYBRID, block_count=3, **{"attention.head_count_kv": [0, 2, 0], "feed_forward_length": [0, 0, 6],
                                            "context_length": 2**20})
# Granite 4.0's dense MLP ([out, in]: 6 features of 8), and its experts beside a shared MLP.
GRANITE_MLP = {"blk.0.ffn_gate.weight": (6, 8), "blk.0.ffn_up.weight": (6, 8), "blk.0.ffn_down.weight": (8, 6)}
GRANITE_EXPERTS = {"blk.1.ffn_gate_inp.weight": (4, 8), "blk.0.ffn_gate_exps.weight": (4, 5, 8),
                   "blk.0.ffn_gate_shexp.weight": (7, 8)}
# granite-4.0-h-tiny-like multipliers (attention.scale in place of head_dim ** -0.5)
GRANITE_SCALES = {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.0078125, "logit_scale": 6.0}
# A nemotron_h_moe file's expert keys (Nemotron 3's), beside Nemotron-H's.
NEMOTRON_3 = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 6,
              "expert_shared_feed_forward_length": 6, "expert_shared_count": 1, "expert_weights_norm": True,
              "expert_weights_scale": 2.5}
# An lfm2moe file's keys (one conv and one attention layer), beside what a case changes.
LFM2_MOE = dict(BASE, **{"attention.head_count_kv": [0, 2], "shortconv.l_cache": 3,
                         "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 64, "expert_count": 4,
                         "expert_used_count": 2, "expert_feed_forward_length": 6, "leading_dense_block_count": 1,
                         "expert_gating_func": 2})
REFUSED = {
    "llama-experts-in-some-layers": ("llama", dict(BASE, expert_count=2, expert_used_count=1),
                                     {"token_embd.weight": (16, 8), **ROUTER_1}, "read as Mixtral"),
    "qwen2moe-sigmoid": ("qwen2moe", dict(BASE, expert_count=2, expert_used_count=1, expert_gating_func=2),
                         {"token_embd.weight": (16, 8), **ROUTER_1}, "sigmoid expert gating is not Qwen2-MoE"),
    "qwen2moe-no-shared-expert": ("qwen2moe", dict(BASE, expert_count=2, expert_used_count=1),
                                  {"token_embd.weight": (16, 8), **ROUTER_1}, "needs the shared expert"),
    "deepseek2-no-latent": ("deepseek2", BASE, {"token_embd.weight": (16, 8)}, "attention.kv_lora_rank"),
    "deepseek2-sigmoid-without-bias": ("deepseek2", dict(LATENT, expert_count=2, expert_used_count=1,
                                                         expert_gating_func=2, leading_dense_block_count=1,
                                                         expert_feed_forward_length=4),
                                       {**LATENT_TENSORS, **ROUTER_1}, "exp_probs_b missing, gating sigmoid"),
    "deepseek2-lengths-disagree": ("deepseek2", dict(LATENT, **{"attention.value_length_mla": 3}), LATENT_TENSORS,
                                   "disagree with the shapes"),
    "deepseek2-no-expert-count": ("deepseek2", dict(LATENT, leading_dense_block_count=1),
                                  {**LATENT_TENSORS, **ROUTER_1}, "deepseek2.expert_count"),
    "mamba2-inner-not-heads": ("mamba2", {"block_count": 1, "embedding_length": 8, "ssm.inner_size": 16,
                                          "ssm.time_step_rank": 3}, {"token_embd.weight": (16, 8)},
                               "ssm.time_step_rank"),
    "granitehybrid-experts-without-tensors": ("granitehybrid", dict(HYBRID, expert_count=4, expert_used_count=2),
                                              HYBRID_TENSORS, "expert_count 4 but no blk.0.ffn_gate_exps.weight, "
                                                              "blk.0.ffn_gate_shexp.weight"),
    "granitehybrid-granite-4-without-mlp": ("granitehybrid", dict(HYBRID, **GRANITE_SCALES), HYBRID_TENSORS,
                                            "Granite 4.0 without experts needs its shared MLP"),
    "granitehybrid-rope-dimension": ("granitehybrid", dict(HYBRID, **{"rope.dimension_count": 3}), HYBRID_TENSORS,
                                     "rope.dimension_count 3 is neither head_dim 2 nor its half"),
    "granitehybrid-no-attention": ("granitehybrid", dict(HYBRID, **{"attention.head_count_kv": [0, 0]}),
                                   HYBRID_TENSORS, "has no attention layer"),
    "granitehybrid-no-mamba": ("granitehybrid", dict(HYBRID, **{"attention.head_count_kv": [2, 2]}),
                               HYBRID_TENSORS, "has no mamba layer"),
    "granitehybrid-one-kv-count": ("granitehybrid", dict(HYBRID, **{"attention.head_count_kv": 2}), HYBRID_TENSORS,
                                   "has no mamba layer"),
    "granitehybrid-kv-counts-short": ("granitehybrid", dict(HYBRID, **{"attention.head_count_kv": [0, 2, 0]}),
                                      HYBRID_TENSORS, "has the wrong length"),
    "granitehybrid-kv-heads-differ": ("granitehybrid", dict(HYBRID, block_count=3,
                                                            **{"attention.head_count_kv": [0, 2, 1]}),
                                      HYBRID_TENSORS, "the attention layers' head_count_kv differ"),
    "granitehybrid-inner-not-heads": ("granitehybrid", dict(HYBRID, **{"ssm.time_step_rank": 3}), HYBRID_TENSORS,
                                      "ssm.time_step_rank"),
    "lfm2-no-conv-layer": ("lfm2", dict(BASE, **{"attention.head_count_kv": [2, 2], "shortconv.l_cache": 3,
                                                 "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 64}),
                           {"token_embd.weight": (16, 8)}, r"0 in the conv layers.*has no conv layer"),
    "nemotron_h-block-both": ("nemotron_h", dict(NEMOTRON_H, feed_forward_length=[0, 6, 6]), HYBRID_TENSORS,
                              "never both nonzero in one block"),
    "nemotron_h-no-mamba": ("nemotron_h", dict(NEMOTRON_H, feed_forward_length=[6, 0, 6]), HYBRID_TENSORS,
                            "needs a Mamba2 block"),
    "nemotron_h-short": ("nemotron_h", dict(NEMOTRON_H, feed_forward_length=[0, 6]), HYBRID_TENSORS,
                         r"must be per block \(3\)"),
    "nemotron_h_moe-groups-unsaid": ("nemotron_h_moe", dict(NEMOTRON_H, **NEMOTRON_3, expert_group_count=2),
                                     HYBRID_TENSORS, "expert_group_count 2 without expert_group_used_count"),
    "nemotron_h_moe-latent": ("nemotron_h_moe", dict(NEMOTRON_H, **NEMOTRON_3, moe_latent_size=4), HYBRID_TENSORS,
                              "latent MoE projection"),
    "mamba-v1": ("mamba", BASE, {"token_embd.weight": (16, 8)}, "unsupported GGUF architecture 'mamba'"),
    "lfm2moe-softmax": ("lfm2moe", dict(LFM2_MOE, expert_gating_func=1), {"token_embd.weight": (16, 8)},
                        r"LFM2-MoE routes by sigmoid scores .*expert_gating_func 1"),
    "lfm2moe-all-dense": ("lfm2moe", dict(LFM2_MOE, leading_dense_block_count=2), {"token_embd.weight": (16, 8)},
                          "leading_dense_block_count 2"),
    "deepseek-v1": ("deepseek", BASE, {"token_embd.weight": (16, 8)}, "unsupported GGUF architecture 'deepseek'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_files_that_contradict_their_family_are_refused(case: str, tmp_path: Path) -> None:
    arch, metadata, tensors, reason = REFUSED[case]
    path = _gguf(tmp_path / f"{case}.gguf", arch, metadata, tensors)
    with pytest.raises(ModelLoadError, match=reason):
        gguf_loader.gguf_hf_config(gguf_loader.open_gguf(path), path)


# Each of Granite 4.0's signs alone makes a granitehybrid file its (a dense MLP tensor in each).
GRANITE_4_SIGNS = {
    "expert-count-0": dict(HYBRID, expert_count=0),
    **{key: dict(HYBRID, **{key: value}) for key, value in GRANITE_SCALES.items()},
    # 1 is not the softmax's own scale (head_dim ** -0.5), which llama.cpp takes it in place of
    "attention-scale-1": dict(HYBRID, **{"attention.scale": 1.0}),
    "no-rope": dict(HYBRID, context_length=2**20, **{"rope.scaling.finetuned": False}),
    "rope-unsaid": {k: v for k, v in HYBRID.items() if k != "rope.scaling.finetuned"},
}


@pytest.mark.parametrize("sign", sorted(GRANITE_4_SIGNS))
def test_granitehybrid_with_a_granite_4_sign_is_granite_4(sign: str, tmp_path: Path) -> None:
    path = _gguf(tmp_path / f"{sign}.gguf", "granitehybrid", GRANITE_4_SIGNS[sign], {**HYBRID_TENSORS, **GRANITE_MLP})
    config = gguf_loader.gguf_hf_config(gguf_loader.open_gguf(path), path)
    assert (config["architectures"], config["model_type"]) == (["GraniteMoeHybridForCausalLM"], "granitemoehybrid")
    assert config["layer_types"] == ["mamba", "attention"] and config["num_local_experts"] == 0
    assert config["shared_intermediate_size"] == 6  # the dense MLP's width, from its tensor


def test_granite_4_fields_come_from_the_keys_and_tensors(tmp_path: Path) -> None:
    metadata = dict(HYBRID, expert_count=4, expert_used_count=2, **GRANITE_SCALES, **{"rope.scaling.finetuned": False})
    path = _gguf(tmp_path / "granite4.gguf", "granitehybrid", metadata, {**HYBRID_TENSORS, **GRANITE_EXPERTS})
    model = ModelConfig.from_hf(gguf_loader.gguf_hf_config(gguf_loader.open_gguf(path), path))
    assert model.architecture == "GraniteMoeHybridForCausalLM" and model.no_rope_layers == (0, 1)
    assert model.scales is not None and (model.scales.embedding, model.scales.residual, model.scales.attention,
                                         model.scales.logits) == (12.0, 0.22, 0.0078125, 6.0)
    assert model.moe is not None and (model.moe.num_experts, model.moe.top_k, model.moe.intermediate_size,
                                      model.moe.shared_expert_intermediate_size) == (4, 2, 5, 7)
    assert model.ssm is not None and model.ssm.layer_kinds == ("mamba", "attention")


def test_granitehybrid_without_granite_4_features_is_bamba(tmp_path: Path) -> None:
    """Multipliers that change nothing (attention.scale the softmax's own) and a rope
    dimension of half the head (a config with attn_rotary_emb) are Bamba's."""
    plain = {"embedding_scale": 1.0, "residual_scale": 1.0, "attention.scale": 2 ** -0.5, "logit_scale": 1.0}
    path = _gguf(tmp_path / "bamba.gguf", "granitehybrid", dict(HYBRID, **plain, **{"rope.dimension_count": 1}),
                 HYBRID_TENSORS)
    config = gguf_loader.gguf_hf_config(gguf_loader.open_gguf(path), path)
    assert (config["architectures"], config["model_type"]) == (["BambaForCausalLM"], "bamba")
    assert (config["attn_layer_indices"], config["num_key_value_heads"], config["head_dim"]) == ([1], 2, 2)
    assert (config["mamba_n_heads"], config["mamba_d_head"], config["mamba_expand"]) == (2, 8, 2)


def test_a_k_b_without_its_v_b_is_refused(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "half.gguf", "deepseek2", LATENT,
                 {**LATENT_TENSORS, "blk.0.attn_k_b.weight": (2, 4, 4)})  # [heads, rank, nope]
    reader = gguf_loader.open_gguf(path)
    weights = gguf_loader.gguf_weights(reader, "deepseek2", gguf_loader.gguf_hf_config(reader, path))
    with pytest.raises(ModelLoadError, match=r"lack their partner \(attn_k_b / attn_v_b"):
        list(weights())


def test_a_gpt_oss_gate_without_its_up_is_refused(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "half.gguf", "gpt-oss", {"embedding_length": 8, "block_count": 1,
                                                      "attention.head_count": 2, "feed_forward_length": 8,
                                                      "expert_count": 2, "expert_used_count": 1,
                                                      "expert_feed_forward_length": 8},
                 {"token_embd.weight": (8, 32), "blk.0.ffn_gate_inp.weight": (8, 2),
                  "blk.0.ffn_gate_exps.weight": (8, 8, 2)})
    reader = gguf_loader.open_gguf(path)
    weights = gguf_loader.gguf_weights(reader, "gpt-oss", gguf_loader.gguf_hf_config(reader, path))
    with pytest.raises(ModelLoadError, match=r"layers.0.ffn_gate_exps.weight'\] lack their partner"):
        list(weights())


def test_deepseek_yarn_is_the_hf_rope_scaling(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite's YaRN as llama.cpp stores it (mscale_all_dim as 0.1 x it in
    yarn_log_multiplier): the same rope settings and softmax scale as its config.json."""
    from kvloom.model_families import MLAConfig

    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
            "rope.scaling.yarn_log_multiplier": 0.0707}
    path = _gguf(tmp_path / "yarn.gguf", "deepseek2", {**LATENT, **yarn}, LATENT_TENSORS)
    config = gguf_loader.gguf_hf_config(gguf_loader.open_gguf(path), path)
    hf_scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    assert config["rope_scaling"] == {"rope_type": "yarn", **{k: v for k, v in hf_scaling.items() if k != "type"}}
    assert MLAConfig.from_hf(config) == MLAConfig.from_hf({**config, "rope_scaling": hf_scaling})
    assert MLAConfig.from_hf(config).softmax_scale != 6 ** -0.5  # the scaling is in it
