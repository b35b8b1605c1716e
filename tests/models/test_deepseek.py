"""DeepSeek-V2/V3 (multi-head latent attention) on tiny random-weight checkpoints built
from transformers' own config classes: greedy tokens identical to transformers in
float32 through chunked prefill, batching, preemption and prefix-cache hits; the pool
holds one latent per token and layer; the absorbed attention equals per-head K/V
attention computed by hand; two ranks; what MLA models refuse."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_models import hf_greedy_tokens, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

# Layer 0 dense, layer 1 a mixture of 4 experts (top 2) and a shared expert.
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, n_shared_experts=1)
SHAPES = {
    "v2": ("deepseek_v2", dict(q_lora_rank=None)),
    "v2-q-lora-group-limited": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=2,
                                                    topk_group=1, routed_scaling_factor=1.5)),
    "v3-interleaved": ("deepseek_v3", dict(q_lora_rank=24, n_group=2, topk_group=1)),
    "v3-halves": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                                      norm_topk_prob=False, routed_scaling_factor=2.5)),
}
LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim


def write(tmp: Path, shape: str) -> Path:
    arch, overrides = SHAPES[shape]
    return write_tiny_hf_model(tmp / shape, arch=arch, **{**MLA, **overrides})



def drive(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt at once, the integrity check after every step."""
    ids = [engine.add_request(p, params).request_id for p in prompts]
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    return [results[i] for i in ids]


@pytest.mark.parametrize("backend", ["mla_cpu", "mla_ref", "mla_batched"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_matches_transformers(shape: str, backend: str, tmp_path: Path) -> None:
    import transformers
    path = write(tmp_path, shape)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(len(shape))
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33, 50)]
    # A small token budget splits the long prompts into chunks; all run batched.
    # mla_cpu is the CPU's kernel: on a GPU machine (scripts/gpu_check.sh) its engine stays on the CPU.
    device = {"device": "cpu"} if backend == "mla_cpu" else {}
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=24,
              attention_backend=backend, **device)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy_tokens(reference, prompt, 8), f"prompt of {len(prompt)} tokens"
    llm.engine.check_integrity()


@pytest.mark.parametrize("shape", ["v2", "v3-interleaved"])
def test_two_ranks_give_transformers_greedy_tokens(shape: str, tmp_path: Path) -> None:
    """Each rank holds two of the four heads (their query and kv_b rows, o_proj's columns,
    all-reduced), the latent projection whole (every rank's pool holds the same latents),
    half of every MLP's and expert's features and of the vocabulary."""
    from helpers_models import assert_greedy_is_transformers
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 30)]
    assert_greedy_is_transformers(write(tmp_path, shape), prompts, 6, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("deepseek"), "v2-q-lora-group-limited")


@pytest.mark.parametrize("shape", ["v2-q-lora-group-limited", "v3-interleaved"])
def test_bf16_tokens_alone_equal_batched_and_chunked(shape: str, tmp_path: Path) -> None:
    """In bf16 on a CPU (the latent attention kernel, each head's up-projections and the
    experts in grouped GEMM calls): a request's tokens do not depend on its batch or chunks
    (the promise is the CPU kernels'; on a GPU machine the engines stay on its CPU)."""
    from helpers_engine import bf16_alone_equals_batched
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 30, 61)]
    engine = bf16_alone_equals_batched(str(write(tmp_path, shape)), prompts,
                                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), device="cpu")
    from kvloom.kernels import latent_attention
    assert engine.runner.backend.name == ("mla_cpu" if latent_attention.available() else "mla_batched")


def test_the_pool_holds_one_latent_per_token_and_layer(v2: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(v2), dtype="float32", block_size=16, num_blocks=8))
    pool = engine.runner.kv_caches
    assert tuple(pool.shape) == (2, 1, 8, 16, 1, LATENT)
    # Two layers x 16 tokens x 40 floats, where per-head K and V would be 4 x (24 + 16).
    from kvloom.runner.kv_pool import bytes_per_block
    assert bytes_per_block(engine.model_config, 16, torch.float32) == 2 * 16 * LATENT * 4


def test_prefix_hits_and_preemption_keep_transformers_tokens(v2: Path) -> None:
    import transformers
    reference = transformers.AutoModelForCausalLM.from_pretrained(v2, dtype=torch.float32).eval()
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 12))] for _ in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy_tokens(reference, p, 24) for p in prompts]
    # 14 blocks of 8 tokens hold about two of these requests: the rest wait or are preempted.
    engine = LLMEngine(EngineConfig.from_kwargs(str(v2), dtype="float32", block_size=8, num_blocks=14,
                                                max_num_batched_tokens=32))
    assert drive(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 7 * 40 // 8 * 8 // 2  # most later prompts hit the shared blocks
    assert engine.kv_manager.num_available_blocks == 14


def test_absorbed_attention_equals_per_head_keys_and_values() -> None:
    """The backend's absorbed form against attention over explicitly expanded per-head
    K = [W_uk c | k_pe] and V = W_uv c, computed by hand."""
    from kvloom.attention.mla_ref import MLAReferenceBackend
    from kvloom.batch import ForwardBatch
    torch.manual_seed(0)
    heads, rank, rope, nope, vdim, block = 3, 12, 4, 6, 5, 4
    seq_lens, query_lens = [7, 3], [3, 1]  # a prefill chunk after 4 cached tokens, and a decode
    backend = MLAReferenceBackend(heads, rank + rope, rank, scale=(nope + rope) ** -0.5)
    pool = torch.zeros(1, 8, block, 1, rank + rope)
    latents = [torch.randn(n, rank + rope) for n in seq_lens]
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    for table, latent in zip(tables, latents, strict=True):  # the cached part, as earlier steps wrote it
        for p in range(latent.shape[0]):
            pool[0, int(table[p // block]), p % block, 0] = latent[p]
    w_uk, w_uv = torch.randn(heads, nope, rank), torch.randn(heads, vdim, rank)
    q_nope = [torch.randn(n, heads, nope) for n in query_lens]
    q_pe = [torch.randn(n, heads, rope) for n in query_lens]
    query = torch.cat([torch.cat((torch.einsum("thn,hnr->thr", a, w_uk), b), -1) for a, b in zip(q_nope, q_pe,
                                                                                                 strict=True)])
    new = torch.cat([latent[-n:] for latent, n in zip(latents, query_lens, strict=True)]).unsqueeze(1)
    slots = [int(tables[i, p // block]) * block + p % block for i, (s, n) in enumerate(zip(seq_lens, query_lens,
                                                                                          strict=True))
             for p in range(s - n, s)]
    batch = ForwardBatch(input_ids=torch.zeros(4, dtype=torch.long), positions=torch.zeros(4, dtype=torch.long),
                         slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=torch.tensor(seq_lens),
                         query_start_loc=torch.tensor([0, 3, 4]), logits_indices=torch.tensor([2, 3]),
                         query_lens_list=query_lens, seq_lens_list=seq_lens, block_size=block)
    out = torch.einsum("thr,hvr->thv", backend.forward(query, new, None, pool, batch, None), w_uv)
    start = 0
    for latent, n, qn, qp in zip(latents, query_lens, q_nope, q_pe, strict=True):
        seq = latent.shape[0]
        for h in range(heads):
            keys = torch.cat((latent[:, :rank] @ w_uk[h].T, latent[:, rank:]), -1)  # [seq, nope + rope]
            values = latent[:, :rank] @ w_uv[h].T  # [seq, vdim]
            for j in range(n):
                visible = seq - n + j + 1
                scores = torch.cat((qn[j, h], qp[j, h])) @ keys[:visible].T * (nope + rope) ** -0.5
                expected = torch.softmax(scores, -1) @ values[:visible]
                torch.testing.assert_close(out[start + j, h], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_what_latent_attention_refuses(v2: Path) -> None:
    with pytest.raises(ValueError, match="does not serve latent attention"):
        LLMEngine(EngineConfig.from_kwargs(str(v2), dtype="float32", num_blocks=8, attention_backend="cpu_paged"))
    with pytest.raises(ValueError, match="layer_skip drafts are not implemented for DeepseekV2ForCausalLM"):
        LLMEngine(EngineConfig.from_kwargs(str(v2), dtype="float32", num_blocks=8,
                                           speculative_config={"method": "layer_skip", "num_layers": 1,
                                                               "num_speculative_tokens": 2}))


def test_auto_picks_the_cpu_kernel_on_cpu_and_the_batched_reference_elsewhere(v2: Path) -> None:
    import json

    from kvloom.attention.registry import backend_for
    from kvloom.config import ModelConfig
    from kvloom.kernels import latent_attention
    config = ModelConfig.from_hf(json.loads((v2 / "config.json").read_text()))
    on_cpu = backend_for(config, "auto", torch.device("cpu")).name
    assert on_cpu == ("mla_cpu" if latent_attention.available() else "mla_batched")
    assert backend_for(config, "auto", torch.device("cuda")).name == "mla_batched"
    with pytest.raises(ValueError, match="'mla_cpu' runs on the CPU only, not cuda; use auto or mla_batched"):
        backend_for(config, "mla_cpu", torch.device("cuda"))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_packed_per_head_projections_equal_the_reference_and_keep_rows_apart(q_lora_rank: int | None) -> None:
    """Packed (bf16, the grouped GEMM with each head a group), a layer's output agrees with
    the per-head einsums in float32 to bf16 rounding, and each row's bits are the same
    in a batch of 6 as alone (the matmuls' invariant; the reference attention over one
    cached sequence of 6 keys, row 5 alone is its last query)."""
    from kvloom.attention.mla_ref import MLAReferenceBackend
    from kvloom.batch import ForwardBatch
    from kvloom.config import ModelConfig
    from kvloom.models.deepseek import LatentAttention
    from kvloom.models.layers import RotaryEmbedding
    hf = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8,
          "kv_lora_rank": 16, "q_lora_rank": q_lora_rank, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
          "v_head_dim": 10, "attention_bias": True, "n_routed_experts": 2, "num_experts_per_tok": 1,
          "first_k_dense_replace": 1, "moe_intermediate_size": 8, "n_shared_experts": 1}
    config = ModelConfig.from_hf(hf)
    assert config.mla is not None
    torch.manual_seed(1)
    attention = LatentAttention(config, config.mla)
    for param in attention.parameters():
        param.data.normal_(0, 0.3)
    backend = MLAReferenceBackend(3, config.mla.latent_dim, 16, config.mla.softmax_scale)
    tokens = 6
    batch = ForwardBatch(input_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens),
                         slot_mapping=torch.arange(tokens), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                         seq_lens=torch.tensor([tokens]), query_start_loc=torch.tensor([0, tokens]),
                         logits_indices=torch.tensor([tokens - 1]), query_lens_list=[tokens], seq_lens_list=[tokens],
                         block_size=4)
    rotary = RotaryEmbedding(8, 16, 10000.0, None).cos_sin(batch.positions)
    hidden = torch.randn(tokens, 48)
    reference = attention(hidden, rotary, batch, torch.zeros(1, 2, 4, 1, config.mla.latent_dim), backend, None)
    from kvloom.models.packed_linear import can_pack_invariant, pack_linear_layers
    attention.to(torch.bfloat16)
    if not can_pack_invariant(attention.kv_b):
        pytest.skip("kvloom's GEMM does not run here")
    assert attention.pack_heads("invariant") == 6
    pack_linear_layers(attention, "invariant")
    cache = torch.zeros(1, 2, 4, 1, config.mla.latent_dim, dtype=torch.bfloat16)
    packed = attention(hidden.bfloat16(), rotary, batch, cache, backend, None)
    torch.testing.assert_close(packed.float(), reference, atol=0.05, rtol=0.05)
    last = ForwardBatch(input_ids=torch.zeros(1, dtype=torch.long), positions=torch.tensor([tokens - 1]),
                        slot_mapping=torch.tensor([tokens - 1]), block_tables=batch.block_tables,
                        seq_lens=torch.tensor([tokens]), query_start_loc=torch.tensor([0, 1]),
                        logits_indices=torch.tensor([0]), query_lens_list=[1], seq_lens_list=[tokens], block_size=4)
    rotary_last = (rotary[0][-1:], rotary[1][-1:])
    alone = attention(hidden.bfloat16()[-1:], rotary_last, last, cache, backend, None)
    assert torch.equal(alone, packed[-1:])


def test_latents_move_between_a_prefill_and_a_decode_instance(v2: Path, tmp_path: Path) -> None:
    """Disaggregation carries the latent pool as it is: one plane, the latent as its head."""
    from kvloom.kv_spec import KVExport, KVImport, StagedKV

    def make(role: str) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(str(v2), dtype="float32", role=role, num_blocks=32,
                                                  kv_shm_dir=str(tmp_path)))

    rng = random.Random(9)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate((5, 17, 40))}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    single = make("both")
    expected = dict(zip(prompts, drive(single, list(prompts.values()), params), strict=True))
    producer, consumer = make("prefill"), make("decode")
    try:
        assert (consumer.kv_layout.num_planes, consumer.kv_layout.num_kv_heads) == (1, 1)
        assert consumer.kv_layout.head_dim == LATENT
        staged = {}
        for rid, prompt in prompts.items():
            producer.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid, kv_transfer=KVExport())
        while producer.has_unfinished_requests():
            for output in producer.step():
                if output.finished:
                    staged[output.request_id] = StagedKV.from_dict(output.kv_transfer_params)
        for rid, prompt in prompts.items():
            consumer.add_request(prompt, params, request_id=rid, kv_transfer=KVImport(staged[rid]))
        got: dict[str, list[int]] = {}
        while consumer.has_unfinished_requests():
            for output in consumer.step():
                if output.finished:
                    got[output.request_id] = output.outputs[0].token_ids
            consumer.check_integrity()
        assert got == expected
        assert consumer.stats().kv_imports == 3
    finally:
        producer.shutdown()
        consumer.shutdown()
