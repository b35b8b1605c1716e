"""What serving through a LoRA adapter costs (run from a checkout: it imports that one): the default model in bf16, a PEFT adapter
of rank 16 on all seven projections (random, written by PEFT from transformers' model of
the GGUF), 16 chat prompts x 64 tokens (ignore_eos), all at once: every request on the
base model, every request on the adapter, and half and half; three alternating rounds
in one process. Also checks the adapter's greedy tokens against PEFT's for one prompt."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

sys.path.insert(0, os.getcwd())  # the checkout run from (a worktree of another revision too)
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
adapted.eval()

llm = LLM("smollm2-135m-instruct", dtype="bfloat16", enable_lora=True)
lora = LoRARequest("r16", 1, str(directory))
topics = ["France", "rain", "gravity", "colors", "rivers", "music", "bread", "stars", "chess", "tea", "snow", "bees",
          "owls", "glass", "maps", "salt"]
prompts = [llm.encode_chat([{"role": "user", "content": f"Tell me about {t}."}]) for t in topics]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], params, lora_request=[lora, None])  # warm-up (and the adapter's load)

one = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   lora_request=lora)[0].outputs[0].token_ids
tokens = list(prompts[0])
with torch.no_grad():
    for _ in range(12):
        tokens.append(int(adapted(torch.tensor([tokens])).logits[0, -1].argmax()))
print("adapter's 12 greedy tokens (bf16) equal PEFT's (float32):", one == tokens[len(prompts[0]):],
      f"(first difference at {next((i for i, (a, b) in enumerate(zip(one, tokens[len(prompts[0]):])) if a != b), None)})")

modes = {"base": [None] * 16, "adapter": [lora] * 16, "half": [lora, None] * 8}
for attempt in range(3):
    for mode in (list(modes) if attempt % 2 == 0 else list(reversed(modes))):
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=modes[mode], use_tqdm=False)
        took = time.perf_counter() - start
        print(f"round {attempt} {mode:8s} 16 x 64 tokens {took:.2f} s ({16 * 64 / took:.0f} tok/s)", flush=True)
sys.exit(0)
