"""Median decode-step and prefill times of a model dir through the engine (whichever kvloom is on the path)."""
import statistics, sys, time
from kvloom import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", block_size=16, num_blocks=64 * 34, max_num_seqs=64,
          max_num_batched_tokens=512 * 64, enable_prefix_caching=False)
def timed(requests, prompt, new):
    p = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(prompt)]} for i in range(requests)]
    s = time.perf_counter(); llm.generate(p, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - s) * 1e3
print("native stack:", llm.engine.model.native_stack is not None)
for label, req, prompt, new in (("prefill 1 x 512", 1, 512, 1), ("b1: 480 + 33", 1, 480, 33), ("b16: 480 + 17", 16, 480, 17)):
    runs = [timed(req, prompt, new) for _ in range(3)]
    print(f"{label:16s} median {statistics.median(runs):8.1f} ms (min {min(runs):.1f})", flush=True)
