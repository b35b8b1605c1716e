"""Beam search with and without tails (a freed request's partly filled last block kept in
the radix cache), alternating in one process: the default model in bf16, width 4, 64
tokens, 4 fresh chat prompts per search (so the cache holds only what the search itself
left). "off" stubs out KVCacheManager._offer_tail, which is all that the feature adds to
the request's path. Prints each search's seconds, ms a round and the prompt tokens its
rounds computed, and checks that both give the same beams (text and score)."""

from __future__ import annotations

import time

from kvloom import LLM, BeamSearchParams, SamplingParams
from kvloom.cache.kv_manager import KVCacheManager

offer_tail = KVCacheManager._offer_tail
llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
topics = ["France", "rain", "gravity", "colors", "rivers", "music", "bread", "stars", "chess", "tea", "snow", "bees",
          "owls", "glass", "maps", "salt", "clocks", "trains", "paper", "wind"]
params = BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True)
llm.beam_search([llm.encode_chat([{"role": "user", "content": "Hello"}])], BeamSearchParams(2, 4))  # warm-up
sampling = SamplingParams(n=4, max_tokens=64, temperature=0.8, seed=0, ignore_eos=True)
results: dict[str, list] = {}
for attempt in range(5):
    for mode in (("on", "off") if attempt % 2 == 0 else ("off", "on")):
        KVCacheManager._offer_tail = offer_tail if mode == "on" else (lambda self, request: None)
        index = 2 * attempt + (mode == "off")
        prompts = [llm.encode_chat([{"role": "user", "content": f"Tell me about {topic}, briefly."}])
                   for topic in topics[(2 * index) % 20:(2 * index) % 20 + 2]]
        scheduler = llm.engine.scheduler
        computed_before, start = scheduler.num_prefill_tokens, time.perf_counter()
        out = llm.beam_search(prompts, params)
        took = time.perf_counter() - start
        computed = scheduler.num_prefill_tokens - computed_before
        print(f"attempt {attempt} tails {mode}: 2 prompts x 4 beams x 64 rounds {took:.2f} s "
              f"({took / 64 * 1000:.1f} ms a round), prompt tokens computed {computed}", flush=True)
KVCacheManager._offer_tail = offer_tail
# The same prompts both ways: the same beams (the copied tokens' KV is the computed one, bit for bit).
prompts = [llm.encode_chat([{"role": "user", "content": "Tell me about the moon."}])]
for mode in ("on", "off"):
    KVCacheManager._offer_tail = offer_tail if mode == "on" else (lambda self, request: None)
    llm.engine.kv_manager.prefix_cache.evict(1 << 30)
    results[mode] = [(s.text, s.cum_logprob) for s in llm.beam_search(prompts, params)[0].sequences]
print("same beams on and off:", results["on"] == results["off"])
start = time.perf_counter()
llm.generate(prompts * 2, sampling, use_tqdm=False)
print(f"sampling 2 prompts x n=4 x 64 tokens: {time.perf_counter() - start:.2f} s")
