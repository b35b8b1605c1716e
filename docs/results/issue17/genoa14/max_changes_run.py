"""The ShareGPT run's first STEPS engine steps (its prompt steps), for a build that counts at exit
(softmax_variants.py count, in a worktree on PYTHONPATH)."""
import sys
from pathlib import Path
from kvloom.bench import datasets
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
steps = int(sys.argv[1])
model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256,
                                            enable_prefix_caching=False))
for request in datasets.load_token_workload(Path.home() / "kvloom-peers/workloads/sharegpt200.jsonl", 200):
    engine.add_request(request.prompt_token_ids, SamplingParams(max_tokens=request.expected_output_len,
                                                                temperature=0.0, ignore_eos=True))
for _ in range(steps): engine.step()
