"""BigCode's GPTBigCode (StarCoder, SantaCoder): GPT-2's model with nn.Linear weights and, where
multi_query (the default), one key and value head for every query head. Greedy tokens and
first log-probs held to transformers in float32 with and without multi_query (c_attn's rows
head by head then, regrouped at load), the native walk in bf16 near transformers' float32, a
LoRA adapter held to PEFT; two ranks refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers_models import assert_bf16_walk_near_float32, assert_greedy_is_transformers, write_tiny_hf_model

from kvloom import LLM

transformers = pytest.importorskip("transformers")

RNG = random.Random(29)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, 47)]
SHAPE = dict(hidden_size=128, n_inner=256, num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=[True, False], ids=["multi_query", "every_head"])
def bigcode(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("bigcode"), arch="gpt_bigcode", seed=81,
                               multi_query=request.param, **SHAPE)


def test_greedy_tokens_and_logprobs_are_transformers(bigcode: Path) -> None:
    config = assert_greedy_is_transformers(bigcode, PROMPTS, 12).engine.model_config
    multi_query = json.loads((bigcode / "config.json").read_text())["multi_query"]
    assert (config.num_heads, config.num_kv_heads, config.hidden_act) == (4, 1 if multi_query else 4,
                                                                          "gelu_pytorch_tanh")


def test_bf16_native_walk_log_probs_are_transformers_float32s(bigcode: Path) -> None:
    assert_bf16_walk_near_float32(bigcode, PROMPTS)


def test_an_adapter_on_every_projection_is_peft(bigcode: Path, tmp_path: Path) -> None:
    from helpers_lora import FAMILY_TARGETS, assert_adapter_is_peft

    assert_adapter_is_peft(bigcode, tmp_path / "adapter", PROMPTS[2:], FAMILY_TARGETS["gpt2"][0])


def test_two_ranks_give_transformers_greedy_tokens_where_the_kv_heads_split(tmp_path: Path) -> None:
    """Every head's K and V (c_attn regrouped, then cut part by part) splits between two ranks;
    multi_query's one KV head does not, refused by name."""
    every_head = write_tiny_hf_model(tmp_path / "bigcode", arch="gpt_bigcode", seed=82, multi_query=False, **SHAPE)
    assert_greedy_is_transformers(every_head, PROMPTS[1:3], 6, tensor_parallel_size=2)
    one = write_tiny_hf_model(tmp_path / "bigcode-mq", arch="gpt_bigcode", seed=83, multi_query=True, **SHAPE)
    with pytest.raises(Exception, match="1 KV heads"):
        LLM(str(one), dtype="float32", num_blocks=16, tensor_parallel_size=2)
