"""OpenAI's GPT-OSS: Llama's layers with biased q/k/v/o, attention sinks, a window on every
other layer, YaRN, and a biased router's softmax over its top-k logits choosing experts with
biases and a clamped SwiGLU, stored in MXFP4 on the hub. Held to transformers: the MoE block
(float32 and bf16 bit for bit), greedy tokens and first log-probs in float32 through chunked
prefill on both CPU attention backends, two ranks (tensor and expert parallel), an MXFP4
checkpoint read back, llama.cpp's gpt-oss GGUF with MXFP4 experts, a LoRA adapter on its
attention and experts (PEFT's); bf16 tokens alone equal batched and chunked; a backend
without sinks refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_engine import bf16_alone_equals_batched
from helpers_models import assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.kernels.mxfp4 import dequantize_mxfp4
from kvloom.model_families import MoEConfig
from kvloom.models.moe import SparseMoE

transformers = pytest.importorskip("transformers")

RNG = random.Random(43)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
# Four layers: windowed (8 keys), full, windowed, full; four experts of 64 features, two a token.
SHAPE = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=4, sliding_window=8,
             max_position_embeddings=4096)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", seed=103, **SHAPE)


def hf_block(dtype: torch.dtype) -> tuple[torch.nn.Module, MoEConfig]:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                                       num_experts_per_tok=3, num_hidden_layers=2, num_attention_heads=4)
    config._experts_implementation = "eager"  # the plain loop, whose rows and adds ours follow
    torch.manual_seed(7)
    block = GptOssMLP(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 1.0)  # wide enough that the clamps at +-7 cut some gates and ups
    moe = MoEConfig.from_hf({**config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert moe is not None and (moe.scoring, moe.hidden_act, moe.top_k) == ("topk_softmax", "swigluoai", 3)
    return block.to(dtype), moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_moe_block_is_transformers(dtype: torch.dtype) -> None:
    """Its layout read back (gate and up columns alternating, [E, in, out] matrices), the
    router's bias and top-k softmax, each expert's biases and clamped SwiGLU: float32 within
    rounding, bf16 the same bits (the module path's plain matmuls, before packing)."""
    block, moe = hf_block(dtype)
    ours = SparseMoE(32, moe)
    for name, tensor in block.state_dict().items():
        ours.load_hf(name, tensor)
    ours = ours.to(dtype)
    x = (torch.randn(29, 32) * 3).to(dtype)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0].reshape(29, 32)
        gate_up = x.float() @ block.experts.gate_up_proj[0].float()
        assert gate_up.abs().max() > moe.swiglu_limit  # the clamps matter here
        got = ours(x)
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            scale = expected.abs().max().item()  # the wide weights' outputs run to hundreds
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
            torch.testing.assert_close(ours.forward_reference(x), expected, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("backend", ["auto", "torch_ref"])
def test_greedy_tokens_and_logprobs_are_transformers(gpt_oss: Path, backend: str) -> None:
    llm = assert_greedy_is_transformers(gpt_oss, PROMPTS, 12, attention_backend=backend)
    config = llm.engine.model_config
    assert config.attention_sinks and config.sliding_window == 8 and config.full_attention_layers == (1, 3)
    assert config.attention_output_bias and config.rope_scaling_dict["rope_type"] == "yarn"


def test_bf16_tokens_alone_equal_batched_and_chunked(gpt_oss: Path) -> None:
    bf16_alone_equals_batched(str(gpt_oss), PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor_parallel", "expert_parallel"])
def test_two_ranks_give_transformers_greedy_tokens(gpt_oss: Path, expert_parallel: bool) -> None:
    """Heads (and their sinks) split; each expert's features split, the down bias added by
    rank 0 alone; or each rank's experts whole."""
    assert_greedy_is_transformers(gpt_oss, PROMPTS[1:3], 6, tensor_parallel_size=2,
                                  enable_expert_parallel=expert_parallel)


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A test's MXFP4 encoding of ``weights`` [..., in] (in a multiple of 32): each block of
    32 scaled by the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest e2m1 number. Returns (blocks [..., in / 32, 16], scales [..., in / 32])."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weights.float().unflatten(-1, (-1, 32))
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0)
    nibbles = codes.to(torch.uint8).unflatten(-1, (16, 2))
    return nibbles[..., 0] | (nibbles[..., 1] << 4), (exponents + 127).to(torch.uint8)


def test_mxfp4_numbers_are_transformers_dequantization() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 10, 128]
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the hub's layout: each fused expert tensor as *_blocks and *_scales of its [E, out,
    in] matrices, quantization_config mxfp4; the same numbers as plain float32 weights, which
    transformers runs: e2m1 values times powers of two are exact in float32)."""
    from safetensors.torch import load_file, save_file

    state = load_file(gpt_oss / "model.safetensors")
    quantized, plain = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state[name].transpose(1, 2))  # [E, out, in / 32, ...]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        del quantized[name]
        plain[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        assert (plain[name] - state[name]).abs().max() < 0.25 * state[name].abs().max()  # a coarse copy of it
    root = tmp_path_factory.mktemp("mxfp4")
    for kind, tensors in (("mxfp4", quantized), ("plain", plain)):
        shutil.copytree(gpt_oss, root / kind)
        save_file(tensors, root / kind / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))
    return root / "mxfp4", root / "plain"


def greedy(path: Path, prompts: list[list[int]], **engine: Any) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=16, max_num_batched_tokens=16, **engine)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        if engine.get("tensor_parallel_size", 1) > 1:
            llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_an_mxfp4_checkpoints_experts_stay_4bit_and_give_its_numbers_tokens(mxfp4_checkpoint: tuple[Path, Path]
                                                                              ) -> None:
    """The experts held as the file's codes and scales (a quarter of bf16's bytes), each
    matmul the MXFP4 kernel's: the tokens of the same numbers as plain weights, which are
    transformers'."""
    from kvloom.kernels.mxfp4 import MXFP4Linear

    quantized, plain = mxfp4_checkpoint
    llm = LLM(str(quantized), dtype="float32", num_blocks=64, block_size=16, max_num_batched_tokens=16)
    moe = next(m for m in llm.engine.model.modules() if isinstance(m, SparseMoE))
    assert moe.mxfp4 is not None and moe.mxfp4.gate_up_blocks.dtype == torch.uint8
    assert isinstance(moe.packed_experts[0][0], MXFP4Linear)  # type: ignore[index]
    assert not hasattr(moe, "experts_gate_up")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    ours = llm.generate(PROMPTS, params)
    reference = LLM(str(plain), dtype="float32", num_blocks=64, block_size=16,
                    max_num_batched_tokens=16).generate(PROMPTS, params)
    for mine, theirs in zip(ours, reference, strict=True):
        tokens = mine.outputs[0].token_ids
        assert tokens == theirs.outputs[0].token_ids
        assert mine.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(
            theirs.outputs[0].logprobs[0][tokens[0]].logprob, abs=1e-4)
    assert_greedy_is_transformers(plain, PROMPTS[2:3], 8)  # and those are transformers' tokens


def test_mxfp4_experts_in_bf16_alone_equal_batched_and_chunked(mxfp4_checkpoint: tuple[Path, Path]) -> None:
    bf16_alone_equals_batched(str(mxfp4_checkpoint[0]), PROMPTS,
                              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor_parallel", "expert_parallel"])
def test_mxfp4_experts_on_two_ranks(mxfp4_checkpoint: tuple[Path, Path], expert_parallel: bool) -> None:
    """Each rank's share of the codes: its rows of gate and up and its groups of down's
    inputs, or its experts whole."""
    quantized, plain = mxfp4_checkpoint
    assert greedy(quantized, PROMPTS[1:3], tensor_parallel_size=2,
                  enable_expert_parallel=expert_parallel) == greedy(plain, PROMPTS[1:3])


def test_mxfp4_experts_dequantized_where_asked_and_half_a_pair_refused(mxfp4_checkpoint: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    quantized, plain = mxfp4_checkpoint
    dense = LLM(str(quantized), dtype="float32", num_blocks=64, hf_overrides={"quantization_config": None})
    moe = next(m for m in dense.engine.model.modules() if isinstance(m, SparseMoE))
    assert moe.mxfp4 is None  # read back to float32 at load, as a checkpoint without the config is
    assert greedy(quantized, PROMPTS, hf_overrides={"quantization_config": None}) == greedy(plain, PROMPTS)
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    state = load_file(broken / "model.safetensors")
    del state[next(n for n in state if n.endswith("_scales"))]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"missing tensors for \['layers.0.mlp.mxfp4.(gate_up|down)_scales"):
        LLM(str(broken), dtype="float32", num_blocks=64)
    with pytest.raises(Exception, match="MXFP4 blocks without their scales"):
        LLM(str(broken), dtype="float32", num_blocks=64, hf_overrides={"quantization_config": None})


def test_adapters_on_attention_and_experts_are_pefts(gpt_oss: Path, tmp_path: Path) -> None:
    """PEFT's target_parameters on its [E, in, out] experts: B's gate_up rows alternate gate and up."""
    from helpers_lora import assert_adapter_is_peft

    assert_adapter_is_peft(gpt_oss, tmp_path / "attention", PROMPTS[2:], ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert_adapter_is_peft(gpt_oss, tmp_path / "experts", PROMPTS[2:], None,
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])


def test_a_backend_without_sinks_is_refused_by_name(gpt_oss: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloom.attention.torch_ref import TorchReferenceBackend

    monkeypatch.setattr(TorchReferenceBackend, "supports_sinks", False)
    with pytest.raises(ValueError, match="'torch_ref' has no attention sinks, which GptOssForCausalLM's layers have"):
        LLM(str(gpt_oss), dtype="float32", num_blocks=16, attention_backend="torch_ref")


def test_a_gguf_file_with_mxfp4_experts_is_the_checkpoint(gpt_oss: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's gpt-oss layout with its experts in ggml's MXFP4 (the checkpoint's experts
    first made MXFP4 numbers by gguf's own quantizer, so the file holds them exactly):
    every tensor read back equals the checkpoint's, and the tokens are transformers'."""
    import gguf
    from helpers_models import write_tiny_gguf_family
    from safetensors.torch import load_file, save_file

    from kvloom.models import gguf_loader
    from kvloom.models.loader import load_checkpoint
    from kvloom.paths import kvloom_home

    home = tmp_path / "home"  # the engine's dequantized GGUF cache here, the built kernels shared
    home.mkdir()
    (kvloom_home() / "kernels").mkdir(parents=True, exist_ok=True)
    (home / "kernels").symlink_to(kvloom_home() / "kernels", target_is_directory=True)
    monkeypatch.setenv("KVLOOM_HOME", str(home))

    state = load_file(gpt_oss / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        turned = state[name].transpose(1, 2).contiguous().numpy()  # [E, out, in]: blocks along in
        exact = gguf.quants.dequantize(gguf.quants.quantize(turned, gguf.GGMLQuantizationType.MXFP4),
                                       gguf.GGMLQuantizationType.MXFP4)
        state[name] = torch.from_numpy(exact).transpose(1, 2).contiguous()
    hf_dir = tmp_path / "hf"
    shutil.copytree(gpt_oss, hf_dir)
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    gguf_file = write_tiny_gguf_family(hf_dir, tmp_path / "gpt-oss.gguf", mxfp4_experts=True)
    types = {t.name: t.tensor_type for t in gguf_loader.open_gguf(gguf_file).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    ours = dict(load_checkpoint(str(gguf_file), home=home, cache_gguf=False).weights())
    assert sorted(ours) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor.float()), name
    assert_greedy_is_transformers(hf_dir, PROMPTS[1:3], 6)
    llm = LLM(str(gguf_file), dtype="float32", num_blocks=64, max_num_batched_tokens=16, block_size=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    from_hf = LLM(str(hf_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16, block_size=16)
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:3], params)]
            == [o.outputs[0].token_ids for o in from_hf.generate(PROMPTS[1:3], params)])


def test_a_prefix_hit_and_preemption_keep_transformers_tokens(gpt_oss: Path) -> None:
    """A second prompt sharing the first's 32 leading tokens (two cached blocks: its sinks and
    windows read them back), in a pool so small that the batch is preempted and recomputed."""
    import transformers as hf
    from helpers_models import hf_greedy_with_cache

    reference = hf.AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()
    base = PROMPTS[3][:40]
    prompts = [base, base[:32] + PROMPTS[2][:9], PROMPTS[2]]
    llm = LLM(str(gpt_oss), dtype="float32", block_size=16, num_blocks=7, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # 65 + 41 tokens: 8 blocks
    first = llm.generate(prompts[:1], params)[0]
    later = llm.generate(prompts[1:], params)
    assert llm.engine.stats().num_preemptions > 0 and later[0].num_cached_tokens == 32
    for output, prompt in zip([first, *later], prompts, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy_with_cache(reference, prompt, 24), len(prompt)
