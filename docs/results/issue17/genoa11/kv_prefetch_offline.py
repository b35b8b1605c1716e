"""The offline ShareGPT run (results/run_vs_openvino.sh's engine settings) with the decoder
stack's KV fetched ahead and without, alternating in one process, the prefix cache emptied
before each: output tok/s a run.

    .venv/bin/python docs/results/issue17/genoa11/kv_prefetch_offline.py WORKLOAD.jsonl NUM_PROMPTS ROUNDS
"""
import sys
from pathlib import Path

import kvloom.models.decoder_stack as stack
from kvloom.bench import datasets
from kvloom.bench.offline import run_offline, warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

path, num_prompts, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256))
requests = datasets.load_token_workload(path, num_prompts)
warm_up(engine)
on = stack.KV_PREFETCH_BYTES
for r in range(rounds):
    for setting in (on, 0) if r % 2 == 0 else (0, on):
        stack.KV_PREFETCH_BYTES = setting
        cache = engine.kv_manager.prefix_cache  # every run starts cold, as a fresh process would
        cache.evict(cache.num_evictable_blocks)
        result = run_offline(engine, requests, "continuous", show_progress=False)
        print(f"round {r} prefetch {setting >> 20:2d} MiB: {result.output_throughput:6.1f} tok/s "
              f"({result.elapsed_s:.1f} s)", flush=True)
