"""DeepSeek-V2-Lite's attention and dense MLP (hidden 2048, 16 heads, a latent of 512 + 64, q/k heads
128 + 64, v 128, no q low rank, MLP 10944) in 4 random-weight bf16 layers, SmolLM2's vocabulary:
prefill 1 x 512 and decode b1 / b16 at context 512, median ms. Run from the tree to measure (its
package first on sys.path): `PYTHONPATH=TREE python v2lite_layers.py WORKDIR`."""

import statistics
import sys
from pathlib import Path

import kvloom
from kvloom.bench.families import write_family
from kvloom.bench.steps import time_decode, time_prefill
from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.loader import load_checkpoint

SHAPE = ("DeepseekV2Config", {
    "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 4,
    "n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 1, "n_shared_experts": 1,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "architectures": ["DeepseekV2ForCausalLM"]})

if __name__ == "__main__":
    sys.stderr.write(f"kvloom from {kvloom.__file__}\n")
    path = write_family(SHAPE, Path(sys.argv[1]), load_checkpoint(DEFAULT_MODEL).tokenizer)
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", enable_prefix_caching=False,
                                                max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=16 * 600 // 16 + 64))
    time_decode(engine, 1, 64, 3, seed=99)
    prefill = time_prefill(engine, 1, 512, 3, seed=7)
    print("prefill 1 x 512", round(statistics.median(prefill.milliseconds), 1))
    for batch in (1, 16):
        timing = time_decode(engine, batch, 512, 10, seed=batch)
        print(f"decode b{batch} x 512", round(statistics.median(timing.milliseconds), 1))
    engine.shutdown()
