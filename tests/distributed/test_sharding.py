"""What each tensor-parallel rank holds and reads, checked against hand-computed
slices and against the whole checkpoint tensors (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import tiny_state_dict, write_tiny_hf_model

from kvloom.config import EngineConfig, ModelConfig
from kvloom.models.loader import load_checkpoint
from kvloom.models.sharding import TensorSlice, llama_weight_slice, rank_view, tensor_parallel_problem, vocab_split

SMOLLM2_135M = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


def test_the_default_models_shape_splits_by_three_not_two() -> None:
    problem = tensor_parallel_problem(SMOLLM2_135M, 2)
    assert problem is not None
    assert "num_attention_heads (9)" in problem and "num_key_value_heads (3)" in problem
    assert tensor_parallel_problem(SMOLLM2_135M, 3) is None
    assert tensor_parallel_problem(SMOLLM2_135M, 1) is None


def test_slices_follow_megatron_split() -> None:
    # 9 heads of 64 over 3 ranks: rank 1 holds query heads 3-5 and KV head 1.
    def part(name: str, rank: int = 1) -> TensorSlice | None:
        return llama_weight_slice(SMOLLM2_135M, name, rank, 3)

    assert part("model.layers.0.self_attn.q_proj.weight") == TensorSlice(0, 192, 384)
    assert part("model.layers.0.self_attn.k_proj.weight") == TensorSlice(0, 64, 128)
    assert part("model.layers.7.self_attn.v_proj.bias") == TensorSlice(0, 64, 128)
    assert part("model.layers.0.mlp.gate_proj.weight") == TensorSlice(0, 512, 1024)
    assert part("model.layers.0.mlp.up_proj.weight", 2) == TensorSlice(0, 1024, 1536)
    assert part("model.layers.0.self_attn.o_proj.weight") == TensorSlice(1, 192, 384)
    assert part("model.layers.0.mlp.down_proj.weight") == TensorSlice(1, 512, 1024)
    assert part("model.embed_tokens.weight", 2) == TensorSlice(0, 32768, 49152)
    assert part("model.layers.0.input_layernorm.weight") is None
    assert part("model.layers.0.mlp.down_proj.bias") is None  # replicated, added by rank 0
    assert llama_weight_slice(SMOLLM2_135M, "model.embed_tokens.weight", 0, 1) is None


def test_a_vocabulary_that_does_not_divide_is_padded() -> None:
    parts = [vocab_split(511, rank, 2) for rank in range(2)]
    assert parts == [(0, 256, 256), (256, 511, 256)]
    assert [vocab_split(10, rank, 4) for rank in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


def test_rank_view_holds_its_share() -> None:
    view = rank_view(SMOLLM2_135M, 3)
    assert (view.num_heads, view.num_kv_heads, view.intermediate_size) == (3, 1, 512)
    assert (view.hidden_size, view.head_dim, view.vocab_size) == (576, 64, 49152)


def test_a_rank_reads_exactly_its_slice_of_each_tensor(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path / "m", max_shard_size="100KB")  # several shards
    whole = tiny_state_dict(path)
    checkpoint = load_checkpoint(str(path))
    config = ModelConfig.from_hf(checkpoint.hf_config)
    for rank in range(2):
        def slice_of(name: str, rank: int = rank) -> TensorSlice | None:
            return llama_weight_slice(config, name, rank, 2)

        read = dict(checkpoint.weights(slice_of))
        assert read.keys() == whole.keys()
        for name, tensor in read.items():
            part = slice_of(name)
            expected = whole[name] if part is None else whole[name].narrow(part.dim, part.start,
                                                                           part.end - part.start)
            assert torch.equal(tensor, expected), name


def test_the_flag_is_checked_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig.from_kwargs("m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="layer_skip"):
        EngineConfig.from_kwargs("m", tensor_parallel_size=2,
                                 speculative_config={"method": "layer_skip", "num_layers": 1})
