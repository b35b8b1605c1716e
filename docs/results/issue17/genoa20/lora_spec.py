"""LoRA with n-gram speculation: the default model in bf16 with a random rank-16 PEFT
adapter on all seven projections, N requests (env N, default 8) on the adapter (or, with
env BASE=1, on the base model) asking to repeat a list (where prompt lookup finds its
drafts) x 96 tokens (ignore_eos), all at once; one engine without speculation and one with
ngram (4 tokens, lookup 3), alternating, three rounds each. Checks that both give the same
tokens (greedy, bf16: speculation changes no bit)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.models.default_model import resolve_default_model

gguf = resolve_default_model()
hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
torch.manual_seed(0)
adapted = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))
with torch.no_grad():
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:
            parameter.mul_(0.05)
directory = Path(tempfile.mkdtemp()) / "adapter"
adapted.save_pretrained(directory)
lora = LoRARequest("r16", 1, str(directory))
LORA = None if os.environ.get("BASE") else lora

items = ["apples", "bread", "candles", "dates", "eggs", "flour", "grapes", "honey", "ink", "jam", "kale", "lemons"]
engines = {"plain": LLM("smollm2-135m-instruct", dtype="bfloat16", enable_lora=True),
           "ngram": LLM("smollm2-135m-instruct", dtype="bfloat16", enable_lora=True,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})}
tokenizer = engines["plain"].tokenizer
ask = "Repeat this list three times, one item a line: "
prompts = [engines["plain"].encode_chat([{"role": "user", "content": ask + ", ".join(items[i:] + items[:i])}])
           for i in range(int(os.environ.get("N", "8")))]
params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
outputs = {}
for name, llm in engines.items():  # warm-up, and the adapter's load
    generated = llm.generate(prompts, params, lora_request=LORA, use_tqdm=False)
    outputs[name] = [o.outputs[0].token_ids for o in generated]
print("same tokens with and without speculation:", outputs["plain"] == outputs["ngram"])
for attempt in range(3):
    for name in (("plain", "ngram") if attempt % 2 == 0 else ("ngram", "plain")):
        start = time.perf_counter()
        engines[name].generate(prompts, params, lora_request=LORA, use_tqdm=False)
        took = time.perf_counter() - start
        rate = len(prompts) * 96 / took
        print(f"round {attempt} {name:6s} {len(prompts)} x 96 tokens {took:.2f} s ({rate:.0f} tok/s)", flush=True)
speculation = engines["ngram"].engine.scheduler.speculation
print(f"drafts accepted: {speculation.num_accepted_tokens} of {speculation.num_draft_tokens}")
