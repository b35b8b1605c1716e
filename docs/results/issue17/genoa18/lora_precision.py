"""How far kvloom in bf16 follows the float32 reference on 4 chat prompts, 24 greedy tokens:
the base model against transformers, and a random rank-16 adapter on all seven projections
against PEFT; prints the first position where the tokens differ (None: all 24 agree)."""
import torch, transformers, tempfile, peft
from pathlib import Path
from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.models.default_model import resolve_default_model
gguf = resolve_default_model()
hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
llm = LLM("smollm2-135m-instruct", dtype="bfloat16", enable_lora=True)
llm32 = None
topics = ["France", "rain", "gravity", "colors"]
prompts = [llm.encode_chat([{"role": "user", "content": f"Tell me about {t}."}]) for t in topics]
def greedy(model, prompt, n):
    t = list(prompt)
    with torch.no_grad():
        for _ in range(n): t.append(int(model(torch.tensor([t])).logits[0, -1].argmax()))
    return t[len(prompt):]
p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
def first_diff(a, b): return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
outs = llm.generate(prompts, p)
for pr, o in zip(prompts, outs):
    print("base bf16 vs hf fp32 first diff:", first_diff(o.outputs[0].token_ids, greedy(hf, pr, 24)))
torch.manual_seed(0)
ad = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
with torch.no_grad():
    for n, q in ad.named_parameters():
        if "lora_B" in n: q.mul_(0.05)
d = Path(tempfile.mkdtemp()) / "a"; ad.save_pretrained(d); ad.eval()
outs = llm.generate(prompts, p, lora_request=LoRARequest("a", 1, str(d)))
for pr, o in zip(prompts, outs):
    print("adapter bf16 vs peft fp32 first diff:", first_diff(o.outputs[0].token_ids, greedy(ad, pr, 24)))
