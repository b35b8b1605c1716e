"""What beam search costs against sampling as many sequences: the default model in bf16, 4
chat prompts a round (fresh ones each attempt, so the prefix cache holds only what the
search itself left), beam width 4 and 64 tokens, against those prompts sampled with n = 4
(16 sequences x 64 tokens, ignore_eos). Prints each attempt's seconds, ms a round, and the
prompt tokens the rounds computed (the rest the radix cache served)."""

from __future__ import annotations

import time

from kvloom import LLM, BeamSearchParams, SamplingParams

llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
topics = ["France", "rain", "gravity", "colors", "rivers", "music", "bread", "stars", "chess", "tea", "snow", "bees"]
params = BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True)
sampling = SamplingParams(n=4, max_tokens=64, temperature=0.8, seed=0, ignore_eos=True)
llm.beam_search([llm.encode_chat([{"role": "user", "content": "Hello"}])], BeamSearchParams(2, 4))  # warm-up
for attempt in range(3):
    prompts = [llm.encode_chat([{"role": "user", "content": f"Tell me about {topic}."}])
               for topic in topics[4 * attempt:4 * attempt + 4]]
    scheduler = llm.engine.scheduler
    cached_before, start = scheduler.num_cached_prompt_tokens, time.perf_counter()
    llm.beam_search(prompts, params)
    beams = time.perf_counter() - start
    served = scheduler.num_cached_prompt_tokens - cached_before
    asked = sum(len(p) + round for p in prompts for round in range(64)) * 4 - 3 * sum(len(p) for p in prompts)
    start = time.perf_counter()
    llm.generate(prompts, sampling, use_tqdm=False)
    plain = time.perf_counter() - start
    print(f"attempt {attempt}: beam search 16 beams x 64 rounds {beams:.2f} s ({beams / 64 * 1000:.1f} ms a round), "
          f"prompt tokens computed {asked - served} of {asked}; sampling 16 x 64 tokens {plain:.2f} s; "
          f"ratio {beams / plain:.2f}x", flush=True)
