"""`kvloom bench families`: what each model family costs in cache memory, and its
decode speed, at one model size.

Each family is a random-weight model (the speed of a step does not depend on the
weights' values) built from transformers' own config class, at about SmolLM2-135M's
size (576 wide, its vocabulary and tokenizer), and written once into
``--workdir``:

- ``llama``: SmolLM2-135M's own shape (30 layers, 9 query heads sharing 3 KV heads
  of 64): K and V of 3 heads per token and layer;
- ``mla``: DeepSeek-V2's latent attention in the same 30 layers (9 heads, a latent of
  256 plus a 32-wide rotary key per token and layer; q/k heads 64 + 32, v 64);
- ``moe``: Mixtral's mixture of experts on SmolLM2's attention (8 experts of 384,
  top 2: half the dense FFN's work per token, 2x its weights);
- ``gpt_oss``: ``moe``'s attention and experts as GPT-OSS has them (q/k/v/o biases,
  sinks, a 128-token window on every other layer, a biased router's softmax over its
  top 2, expert biases, the clamped SwiGLU): what those cost against Mixtral's;
- ``mamba2``: Mamba2-130m's shape (768 wide, 24 mixers, no attention): a fixed state
  per request, no KV at all;
- ``hybrid``: Bamba, SmolLM2's width and depth with 5 attention layers among 30, the
  others Mamba2 mixers (a 64-wide state per head).

For each: the cache's bytes per token (every layer), a request's fixed state bytes
(state-space models), the most requests of ``context`` tokens that ``memory_gib`` of
cache and state holds, and pure decode steps timed at each batch size
(``bench steps``'s ``time_decode``: median step time, tokens per second); the step
that computes one fresh prompt of ``context`` tokens, and, with prefix caching on, the
step that computes ``PREFIX_SUFFIX`` tokens after a hit of ``context`` tokens (for a
state-space model the hit restores a state checkpoint: engine/state_space.py); and for
a state-space model the copy of one state slot, which each checkpoint's save and each
hit's restore costs.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvloom.batch import StateCopy
from kvloom.bench.steps import time_decode, time_prefill, time_prefix_hit
from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.loader import load_checkpoint
from kvloom.tokenizer import Tokenizer

GIB = 1 << 30
PREFIX_SUFFIX = 16  # fresh tokens after the prefix-cache hit that is timed
_SMOLLM = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
# family -> (transformers config class, its settings)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_SMOLLM, "num_key_value_heads": 3, "architectures": ["LlamaForCausalLM"]}),
    "mla": ("DeepseekV2Config", {**_SMOLLM, "num_key_value_heads": 9, "kv_lora_rank": 256, "q_lora_rank": None,
                                 "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                                 "first_k_dense_replace": 30, "n_routed_experts": 1, "num_experts_per_tok": 1,
                                 "moe_intermediate_size": 1, "n_shared_experts": 1,
                                 "architectures": ["DeepseekV2ForCausalLM"]}),
    # SmolLM2's attention; each FFN 8 experts of a quarter of its width, top 2 (half its FLOPs).
    "moe": ("MixtralConfig", {**_SMOLLM, "num_key_value_heads": 3, "intermediate_size": 384, "num_local_experts": 8,
                              "num_experts_per_tok": 2, "architectures": ["MixtralForCausalLM"]}),
    # The same active width in fine-grained experts (OLMoE's and Qwen3-MoE's kind): 64 of 96, top 8.
    "moe_fine": ("MixtralConfig", {**_SMOLLM, "num_key_value_heads": 3, "intermediate_size": 96,
                                   "num_local_experts": 64, "num_experts_per_tok": 8,
                                   "architectures": ["MixtralForCausalLM"]}),
    # The same attention and experts in GPT-OSS's form (its window every other layer, sinks, biases).
    "gpt_oss": ("GptOssConfig", {**_SMOLLM, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 384,
                                 "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 128,
                                 "architectures": ["GptOssForCausalLM"]}),
    # Mamba2-130m's own shape (768 wide, 24 mixers, a 128-wide state per head of 64).
    "mamba2": ("Mamba2Config", {"vocab_size": 49152, "hidden_size": 768, "num_hidden_layers": 24, "state_size": 128,
                                "head_dim": 64, "num_heads": 24, "expand": 2, "n_groups": 1, "conv_kernel": 4,
                                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                                "architectures": ["Mamba2ForCausalLM"]}),
    # SmolLM2's width and depth with one attention layer in six, the rest Mamba2 mixers.
    "hybrid": ("BambaConfig", {**_SMOLLM, "num_key_value_heads": 3, "attn_layer_indices": [5, 11, 17, 23, 29],
                               "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1,
                               "mamba_d_conv": 4, "mamba_expand": 2, "architectures": ["BambaForCausalLM"]}),
    # The same stack as IBM Granite 4.0 publishes it (granite-4.0-h-micro's form): no rotary, the
    # shared MLP as each layer's dense MLP (no experts), Granite's multipliers.
    "granite4": ("GraniteMoeHybridConfig", {
        **_SMOLLM, "num_key_value_heads": 3, "shared_intermediate_size": _SMOLLM["intermediate_size"],
        "num_local_experts": 0, "position_embedding_type": None,
        "layer_types": ["attention" if i % 6 == 5 else "mamba" for i in range(30)],  # SmolLM2's 30 layers
        "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "logits_scaling": 8.0, "architectures": ["GraniteMoeHybridForCausalLM"]}),
    # The same stack with granite-4.0-h-tiny's feed-forward at SmolLM2's width: 64 routed experts of
    # 192 features, top 6, beside a shared MLP of 384 in every layer.
    "granite4_moe": ("GraniteMoeHybridConfig", {
        **_SMOLLM, "num_key_value_heads": 3, "intermediate_size": 192, "shared_intermediate_size": 384,
        "num_local_experts": 64, "num_experts_per_tok": 6, "position_embedding_type": None,
        "layer_types": ["attention" if i % 6 == 5 else "mamba" for i in range(30)],
        "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "logits_scaling": 8.0, "architectures": ["GraniteMoeHybridForCausalLM"]}),
    # SmolLM2's width and depth as LiquidAI's LFM2: gated short convolutions (3 taps) in 20 of the
    # 30 layers, attention with per-head q/k norms in the rest (LFM2-350M's share), SmolLM2's MLP
    # width after LFM2's two-thirds adjustment (2304 -> 1536).
    "lfm2": ("Lfm2Config", {
        **_SMOLLM, "num_key_value_heads": 3, "intermediate_size": 2304, "block_multiple_of": 256, "conv_L_cache": 3,
        "layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(30)],
        "architectures": ["Lfm2ForCausalLM"]}),
    # The same LFM2 with LFM2-8B-A1B's feed-forward at SmolLM2's width: two dense layers, then 32
    # experts of 384 features, top 4 by sigmoid score steered by a selection bias.
    "lfm2_moe": ("Lfm2MoeConfig", {
        **_SMOLLM, "num_key_value_heads": 3, "intermediate_size": 1536, "moe_intermediate_size": 384,
        "num_experts": 32, "num_experts_per_tok": 4, "num_dense_layers": 2, "conv_L_cache": 3,
        "layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(30)],
        "architectures": ["Lfm2MoeForCausalLM"]}),
    # SmolLM2's width as NVIDIA Nemotron-H's single-mixer blocks: 30 blocks of Mamba2 mixers and
    # squared-ReLU MLPs taking turns, 3 of them attention (Nemotron-H-8B's "M-M-M-M*-" pattern).
    "nemotron_h": ("NemotronHConfig", {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "hybrid_override_pattern": "M-M-M-M*-" * 3
        + "M-M", "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "mamba_num_heads": 18,
        "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "conv_kernel": 4, "chunk_size": 128,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "architectures": ["NemotronHForCausalLM"]}),
}


@dataclass(frozen=True)
class FamilyResult:
    family: str
    architecture: str
    parameters: int
    cache_bytes_per_token: int  # every layer's share of the paged pool, per token
    state_bytes_per_request: int  # fixed per request (state-space layers); 0 for attention only
    max_requests: int  # of `context` tokens in `memory_gib` of cache and state
    prefill_ms: float  # median step computing one fresh prompt of `context` tokens
    prefix_hit_ms: float  # median step computing PREFIX_SUFFIX tokens after a `context`-token hit
    state_copy_ms: float  # one state slot copied (a checkpoint's save or a hit's restore); 0 without state
    decode: dict[int, dict[str, float]]  # batch -> median step ms, tokens/s


def write_family(shape: tuple[str, dict[str, Any]], target: Path, tokenizer: Tokenizer) -> Path:
    """A random-weight bf16 checkpoint of ``shape`` (a transformers config class and its
    settings) in ``target``, with ``tokenizer``; kept if already written."""
    import transformers
    stamp = json.dumps(shape, sort_keys=True)
    if (target / "family.json").exists() and (target / "family.json").read_text() == stamp:
        return target
    class_name, settings = shape
    config = getattr(transformers, class_name)(**settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(target)
    tokenizer.save(target)
    (target / "family.json").write_text(stamp)  # last: marks the directory complete
    return target


def measure_family(family: str, path: Path, batches: list[int], context: int, decode_steps: int,
                   memory_gib: float, engine_kwargs: dict[str, Any]) -> FamilyResult:
    largest = max(batches)
    kwargs: dict[str, Any] = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=max(largest, 64),
                                  max_num_batched_tokens=2048,
                                  num_blocks=largest * (context + decode_steps + 64) // 16 + 64)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), **kwargs))
    pool = engine.runner.kv_caches
    blocks = pool.shape[2]
    per_token = pool.numel() * pool.element_size() // (blocks * pool.shape[3])
    state = engine.state_bytes_per_slot
    max_requests = int(memory_gib * GIB // (per_token * context + state))
    decode: dict[int, dict[str, float]] = {}
    time_decode(engine, batches[0], min(context, 64), 3, seed=99)  # warm-up
    prefill = time_prefill(engine, 1, context, 3, seed=7)
    print(f"{family:<8} {prefill.summary}", flush=True)
    for batch in batches:
        timing = time_decode(engine, batch, context, decode_steps, seed=batch)
        median = statistics.median(timing.milliseconds)
        decode[batch] = {"median_step_ms": round(median, 2), "tokens_per_s": round(batch * 1000 / median, 1)}
        print(f"{family:<8} {timing.summary}", flush=True)
    copy_ms = _time_state_copy(engine) if state else 0.0
    engine.shutdown()
    # The prefix cache on (a fresh engine: above, a prompt's last-block checkpoint would
    # split every timed prefill in two).
    cached = LLMEngine(EngineConfig.from_kwargs(str(path), **{**kwargs, "enable_prefix_caching": True}))
    hit = time_prefix_hit(cached, context // 16 * 16, PREFIX_SUFFIX, 3, seed=11)
    print(f"{family:<8} {hit.summary}", flush=True)
    cached.shutdown()
    parameters = _checkpoint_parameters(path)
    return FamilyResult(family, engine.model_config.architecture, parameters, per_token, state,
                        max_requests, round(statistics.median(prefill.milliseconds), 2),
                        round(statistics.median(hit.milliseconds), 2), copy_ms, decode)


def _time_state_copy(engine: LLMEngine, repeats: int = 20) -> float:
    """Median ms of copying one state slot into another, every mixer layer (the runner's
    copy for a checkpoint's save or a hit's restore)."""
    from kvloom.models.mamba2 import copy_state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy_state(engine.model, [StateCopy(0, 1)])
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def _checkpoint_parameters(path: Path) -> int:
    """Numbers in the checkpoint (the packed weights the engine holds are not parameters)."""
    from safetensors import safe_open
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total


def run_families(families: list[str], workdir: Path, batches: list[int], context: int, decode_steps: int,
                 memory_gib: float, engine_kwargs: dict[str, Any], tokenizer: Tokenizer | None = None,
                 shapes: dict[str, tuple[str, dict[str, Any]]] | None = None) -> list[FamilyResult]:
    """``shapes``: instead of FAMILIES; ``tokenizer``: instead of the default model's."""
    shapes = shapes or FAMILIES
    unknown = sorted(set(families) - set(shapes))
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {sorted(shapes)}")
    tokenizer = tokenizer or load_checkpoint(DEFAULT_MODEL).tokenizer
    results = []
    for family in families:
        path = write_family(shapes[family], workdir / family, tokenizer)
        results.append(measure_family(family, path, batches, context, decode_steps, memory_gib, engine_kwargs))
    return results


def format_families(results: list[FamilyResult], context: int, memory_gib: float) -> str:
    batches = sorted({b for r in results for b in r.decode})
    head = (f"| family | parameters | cache bytes/token | state bytes/request | requests of {context} tokens "
            f"in {memory_gib:g} GiB | prefill 1 x {context}: ms | prefill 1 x {PREFIX_SUFFIX} after a hit: ms | "
            f"state copy: ms | " + " | ".join(f"decode b{b}: ms/step, tok/s" for b in batches) + " |")
    lines = [head, "|" + "---|" * (8 + len(batches))]
    for r in results:
        cells = [f"{r.decode[b]['median_step_ms']}, {r.decode[b]['tokens_per_s']}" for b in batches]
        lines.append(f"| {r.family} ({r.architecture}) | {r.parameters / 1e6:.1f} M | {r.cache_bytes_per_token:,} | "
                     f"{r.state_bytes_per_request:,} | {r.max_requests:,} | {r.prefill_ms} | {r.prefix_hit_ms} | "
                     f"{r.state_copy_ms} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def as_json(results: list[FamilyResult]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(asdict(r))) for r in results]
