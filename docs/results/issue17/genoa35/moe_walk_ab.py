"""A/B in one process: a mixture-of-experts model's steps with the native walk and with its
module path (model.native_stack set aside), alternating: a 512-token prompt's prefill and
decode steps at batch 1, 16 and 64 (context 512). Usage: moe_walk_ab.py MODEL_DIR."""

from __future__ import annotations

import statistics
import sys
import time

from kvloom import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="bfloat16", block_size=16, num_blocks=64 * 34, max_num_seqs=64,
          max_num_batched_tokens=512 * 64, enable_prefix_caching=False)
model = llm.engine.model
walk = model.native_stack
assert walk is not None, "the walk does not serve this model"


def timed(requests: int, prompt: int, new: int) -> float:
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(prompt)]} for i in range(requests)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


for label, requests, prompt, new in (("prefill 1 x 512", 1, 512, 1), ("decode b1 (32 tokens)", 1, 480, 33),
                                     ("decode b16 (16 tokens)", 16, 480, 17), ("decode b64 (8 tokens)", 64, 480, 9)):
    runs: dict[str, list[float]] = {"walk": [], "modules": []}
    for _ in range(5):
        for name in ("modules", "walk"):
            model.native_stack = walk if name == "walk" else None
            runs[name].append(timed(requests, prompt, new))
    print(f"{label:24s} modules {statistics.median(runs['modules']):8.1f} ms  walk {statistics.median(runs['walk']):8.1f}"
          f" ms  (min {min(runs['modules']):.1f} / {min(runs['walk']):.1f})", flush=True)
model.native_stack = walk
