"""experts_grouped with the activation and the routing weights over every pair at once,
against the previous expert-by-expert loop (its copy passed as argv[1]), alternating in one
process on a random-weight OLMoE-shaped model (64 experts, top 8, 4 layers, hidden 512),
bf16, 16 x 48 greedy tokens; the tokens must be the same either way. From the repo root:
.venv/bin/python docs/results/issue17/genoa31/moe_batched_ab.py /path/to/old/moe.py"""
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests")
from helpers_models import write_tiny_hf_model  # noqa: E402

import kvloom.models.moe as moe  # noqa: E402
from kvloom import LLM, SamplingParams  # noqa: E402

spec = importlib.util.spec_from_file_location("moe_before", sys.argv[1])
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
paths = {"before": before.experts_grouped, "after": moe.experts_grouped}
base = write_tiny_hf_model(Path(tempfile.mkdtemp()) / "olmoe", arch="olmoe", seed=1, hidden_size=512,
                           intermediate_size=256, num_attention_heads=8, num_key_value_heads=8, num_experts=64,
                           num_experts_per_tok=8, num_hidden_layers=4)
llm = LLM(str(base), dtype="bfloat16", num_blocks=256)
prompts = [[(7 * i + j) % 400 + 3 for j in range(64)] for i in range(16)]
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
tokens = {}
for round_ in range(4):
    for name, function in paths.items():
        moe.experts_grouped = function
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens.setdefault(name, [o.outputs[0].token_ids for o in outputs])
        print(f"round {round_ + 1} {name:6s} {seconds:6.3f} s", flush=True)
print("same tokens:", tokens["before"] == tokens["after"])
