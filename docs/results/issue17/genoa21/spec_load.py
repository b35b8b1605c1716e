"""N-gram speculation under a steady load rather than one batch that drains: M requests
through S sequence slots (max_num_seqs), so that every step but the last few runs S
requests, as a server under load does. The default model in bf16, greedy, 96 tokens each
(ignore_eos), prompts asking to repeat, reverse, sort or use a list (prompt lookup finds
drafts in some more than others). One engine without speculation and one with ngram (4
tokens, lookup 3), alternating, three rounds; the same tokens from both. With env LORA=1
every request runs a random rank-16 PEFT adapter on all seven projections (as
genoa20/lora_spec.py).

Usage (repository root): S=8 M=48 [LORA=1] .venv/bin/python docs/results/issue17/genoa21/spec_load.py"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from kvloom import LLM, LoRARequest, SamplingParams

S, M = int(os.environ.get("S", "8")), int(os.environ.get("M", "48"))
lora = None
if os.environ.get("LORA"):
    import peft
    import torch
    import transformers

    from kvloom.models.default_model import resolve_default_model
    gguf = resolve_default_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(hf, peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.05)
    directory = Path(tempfile.mkdtemp()) / "adapter"
    adapted.save_pretrained(directory)
    lora = LoRARequest("r16", 1, str(directory))

common = dict(dtype="bfloat16", max_num_seqs=S, enable_lora=lora is not None)
engines = {"plain": LLM("smollm2-135m-instruct", **common),
           "ngram": LLM("smollm2-135m-instruct", **common,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})}
items = ["apples", "bread", "candles", "dates", "eggs", "flour", "grapes", "honey", "ink", "jam", "kale", "lemons"]
asks = ["Repeat this list three times, one item a line: ", "Write this list backwards and then forwards: ",
        "Sort these words alphabetically: ", "Tell a short story that uses these words: "]
chat = engines["plain"].encode_chat
prompts = [chat([{"role": "user", "content": asks[i % 4] + ", ".join(items[i % 12:] + items[:i % 12])}])
           for i in range(M)]
params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
outputs = {}
for name, llm in engines.items():  # warm-up (and the adapter's load)
    outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]
print(f"S={S} M={M} lora={lora is not None}: same tokens with and without speculation:",
      outputs["plain"] == outputs["ngram"])
for attempt in range(3):
    for name in (("plain", "ngram") if attempt % 2 == 0 else ("ngram", "plain")):
        start = time.perf_counter()
        engines[name].generate(prompts, params, lora_request=lora, use_tqdm=False)
        took = time.perf_counter() - start
        print(f"round {attempt} {name:6s} {took:.2f} s ({M * 96 / took:.0f} tok/s)", flush=True)
speculation = engines["ngram"].engine.scheduler.speculation
print(f"drafts accepted: {speculation.num_accepted_tokens} of {speculation.num_draft_tokens}")
