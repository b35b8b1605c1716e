"""Offline 16 x 64 tokens on the default model (bf16) with the decoder walked natively or as
PyTorch modules (the path a step with LoRA rows takes): python module_path.py native|modules."""
import time
from kvloom import LLM, SamplingParams
import sys
llm = LLM("smollm2-135m-instruct", dtype="bfloat16", decoder_stack=sys.argv[1])
topics = ["France", "rain", "gravity", "colors", "rivers", "music", "bread", "stars", "chess", "tea", "snow", "bees", "owls", "glass", "maps", "salt"]
prompts = [llm.encode_chat([{"role": "user", "content": f"Tell me about {t}."}]) for t in topics]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], params)
for r in range(3):
    s = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); t = time.perf_counter() - s
    print(sys.argv[1], f"{t:.2f} s")
