import statistics, sys, time
from kvloom import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", block_size=16, num_blocks=512, max_num_batched_tokens=2048, enable_prefix_caching=False)
model = llm.engine.model; walk = model.native_stack
def timed(n):
    p = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(n)]} for i in range(1)]
    s = time.perf_counter(); llm.generate(p, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False); return (time.perf_counter() - s) * 1e3
for n in (512, 2048):
    r = {"walk": [], "modules": []}
    for _ in range(7):
        for name in ("modules", "walk"):
            model.native_stack = walk if name == "walk" else None
            r[name].append(timed(n))
    print(sys.argv[1].split("/")[-1], n, "modules", round(statistics.median(r["modules"]), 1), "walk", round(statistics.median(r["walk"]), 1), "mins", round(min(r["modules"]),1), round(min(r["walk"]),1), flush=True)
