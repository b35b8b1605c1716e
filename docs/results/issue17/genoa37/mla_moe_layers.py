"""The families bench's MLA shape (SmolLM2's 30 layers, 9 heads, a latent of 256 + 32) with DeepSeek-V2's
experts in place of its dense MLPs after the first layer: 8 routed experts of 384 features, top 2 by a
float32 softmax router (greedy, unscaled), one shared expert of 384: the families bench's "moe" shape's
experts. Random bf16 weights, SmolLM2's vocabulary; prefill 1 x 512 and decode b1 / b16 / b64 at context
512, median ms. Run from the tree to measure (its package first on sys.path):
`PYTHONPATH=TREE python mla_moe_layers.py WORKDIR`."""

import statistics
import sys
from pathlib import Path

import kvloom
from kvloom.bench.families import FAMILIES, write_family
from kvloom.bench.steps import time_decode, time_prefill
from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.models.loader import load_checkpoint

SHAPE = (FAMILIES["mla"][0], {**FAMILIES["mla"][1], "first_k_dense_replace": 1, "n_routed_experts": 8,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 384, "n_shared_experts": 1,
                              "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0})

if __name__ == "__main__":
    sys.stderr.write(f"kvloom from {kvloom.__file__}\n")
    path = write_family(SHAPE, Path(sys.argv[1]), load_checkpoint(DEFAULT_MODEL).tokenizer)
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", enable_prefix_caching=False,
                                                max_num_seqs=64, max_num_batched_tokens=2048,
                                                num_blocks=64 * 600 // 16 + 64))
    sys.stderr.write(f"native walk: {getattr(engine.model, 'native_stack', None) is not None}\n")
    time_decode(engine, 1, 64, 3, seed=99)
    prefill = time_prefill(engine, 1, 512, 3, seed=7)
    print("prefill 1 x 512", round(statistics.median(prefill.milliseconds), 1))
    for batch in (1, 16, 64):
        timing = time_decode(engine, batch, 512, 10, seed=batch)
        print(f"decode b{batch} x 512", round(statistics.median(timing.milliseconds), 1))
    engine.shutdown()
