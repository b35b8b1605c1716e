"""LoRA on routed experts, what it costs: a random-weight OLMoE-shaped model (64 experts, top 8,
4 layers, hidden 512, expert width 256), bf16, 16 requests x 48 greedy tokens from 64-token prompts,
the base model against a rank-16 adapter on the experts' two tensors and the attention (all rows on
it), then half the rows on it; three alternating rounds. Run from the repo root:
.venv/bin/python docs/results/issue17/genoa31/lora_experts.py"""
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests")
from helpers_lora import write_adapter  # noqa: E402
from helpers_models import write_tiny_hf_model  # noqa: E402

from kvloom import LLM, LoRARequest, SamplingParams  # noqa: E402

root = Path(tempfile.mkdtemp())
base = write_tiny_hf_model(root / "olmoe", arch="olmoe", seed=1, hidden_size=512, intermediate_size=256,
                           num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
                           num_hidden_layers=4)
adapter = write_adapter(base, root / "adapter", 1, 16, ["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
llm = LLM(str(base), dtype="bfloat16", num_blocks=256, enable_lora=True, max_lora_rank=16)
prompts = [[(7 * i + j) % 400 + 3 for j in range(64)] for i in range(16)]
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
lora = LoRARequest("a", 1, str(adapter))
runs = {"base": None, "adapter": lora, "half": [lora, None] * 8}
llm.generate(prompts[:2], params, lora_request=lora)  # warm: the adapter loaded, kernels built
for round_ in range(3):
    for name, request in runs.items():
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=request)
        seconds = time.perf_counter() - start
        print(f"round {round_ + 1} {name:8s} {seconds:6.2f} s  {16 * 48 / seconds:6.1f} tok/s", flush=True)
