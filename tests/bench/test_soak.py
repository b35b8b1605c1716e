"""`kvloom bench soak` end to end on a tiny bf16 model (head_dim 64: the layout whose
attention is batch-invariant): nothing lost, no block leaked, no engine fault, only
hostile requests refused, and every greedy output equal to the request run alone."""

from __future__ import annotations

import pytest
from helpers_lora import TARGETS_ALL, write_adapter
from helpers_models import write_tiny_hf_model

from kvloom.bench.soak import SoakConfig, format_soak, plan_requests, run_soak


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("soak"), arch="llama", hidden_size=256,
                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def test_soak_loses_nothing_and_leaks_nothing(tiny_bf16) -> None:
    config = SoakConfig(str(tiny_bf16), {"dtype": "bfloat16"}, num_requests=120, concurrency=16, seed=3)
    result = run_soak(config)
    report = format_soak(result)
    assert result["sent"] == 120, report
    assert result["lost"] == 0 and result["kv_blocks_leaked"] == 0 and result["engine_faults"] == 0, report
    by_kind = result["by_kind"]
    assert set(by_kind["hostile"]) == {"refused"} and by_kind["hostile"]["refused"] > 0, report
    assert set(by_kind["ordinary"]) == {"ok"}, report
    assert by_kind["stream_disconnect"].get("disconnected", 0) > 0, report
    assert result["preemptions"] > 0, report  # the pool really was too small
    assert result["greedy_compared"] > 10 and result["greedy_equal_alone"] == result["greedy_compared"], report


def test_soak_with_adapters_and_speculation_on_every_endpoint(tiny_bf16, tmp_path) -> None:
    """Three LoRA adapters on two slots, with n-gram speculation, over completions, chat
    (tools, schemas, n, beam search), Messages, Responses, embeddings, /pooling (a vector per
    token, every position computed through chunks and preemptions) and /invocations: half
    the requests name an adapter, so some wait for a slot (none is refused), under
    preemption, disconnects and aborts; each greedy answer (an embedding too) is the same
    request's sent alone, on its adapter."""
    adapters = tuple((f"a{i}", str(write_adapter(tiny_bf16, tmp_path / f"a{i}", i, 4, TARGETS_ALL)))
                     for i in range(3))
    engine = {"dtype": "bfloat16", "enable_lora": True, "max_loras": 2, "max_lora_rank": 4,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    config = SoakConfig(str(tiny_bf16), engine, num_requests=120, concurrency=16, seed=5, lora_modules=adapters,
                        endpoints="all")
    plan = plan_requests(config)
    assert sum(isinstance(r.payload, dict) and r.payload.get("model", "").startswith("a") for r in plan) > 40
    assert {r.path for r in plan} == {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                                      "/v1/embeddings", "/invocations", "/pooling"}
    result = run_soak(config)
    report = format_soak(result)
    assert result["lost"] == 0 and result["kv_blocks_leaked"] == 0 and result["engine_faults"] == 0, report
    assert set(result["by_kind"]["ordinary"]) == {"ok"}, report
    assert result["preemptions"] > 0, report
    assert result["greedy_compared"] > 10 and result["greedy_equal_alone"] == result["greedy_compared"], report
