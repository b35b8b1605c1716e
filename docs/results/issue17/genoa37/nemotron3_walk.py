"""Nemotron 3's shape in miniature (NVIDIA Nemotron-H blocks with MoE blocks: hidden 576, 12 blocks
M E * E M E M E * E M E; Mamba2 mixers of 9 heads x 64, 8 groups; attention 9 heads of 64, 3 KV heads;
8 experts of 384 features without a gate, top 2 by a float32 sigmoid router in 2 groups, a shared
expert of 768), random bf16 weights: decode b1 / b16 at context 256 and a 512-token prompt, median ms,
the native walk against the modules (`--decoder-stack modules`) alternating in one process.
`python nemotron3_walk.py WORKDIR` from the repository root."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from helpers_ssm import write_tiny_ssm_model  # noqa: E402

from kvloom.bench.steps import time_decode, time_prefill  # noqa: E402
from kvloom.config import EngineConfig  # noqa: E402
from kvloom.engine.engine import LLMEngine  # noqa: E402

BLOCKS = ["mamba", "moe", "attention", "moe", "mamba", "moe", "mamba", "moe", "attention", "moe", "mamba", "moe"]
path = write_tiny_ssm_model(Path(sys.argv[1]), "nemotron_h_moe", hidden_size=576, intermediate_size=1536,
                            layers_block_type=BLOCKS, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                            mamba_num_heads=9, mamba_head_dim=64, ssm_state_size=64, n_groups=1, chunk_size=64,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
                            moe_shared_expert_intermediate_size=768, n_group=2, topk_group=1, vocab_size=4096,
                            max_position_embeddings=4096)
engines = {stack: LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", enable_prefix_caching=False,
                                                     max_num_seqs=16, max_num_batched_tokens=1024, num_blocks=2048,
                                                     decoder_stack=stack))
           for stack in ("native", "modules")}
assert engines["native"].model.native_stack is not None and engines["modules"].model.native_stack is None
for engine in engines.values():
    time_decode(engine, 1, 32, 3, seed=99)
for round_ in range(2):
    for stack, engine in engines.items():
        prefill = statistics.median(time_prefill(engine, 1, 512, 3, seed=7).milliseconds)
        b1 = statistics.median(time_decode(engine, 1, 256, 10, seed=1).milliseconds)
        b16 = statistics.median(time_decode(engine, 16, 256, 10, seed=16).milliseconds)
        print(f"round {round_ + 1} {stack:8s} prefill 1 x 512 {prefill:7.1f}  decode b1 {b1:6.1f}  b16 {b16:6.1f} ms")
