"""LoRA adapters on an un-gated MLP's fc1 / fc2 in the native walk (the thirtieth session):
a random-weight Phi-2-kind model at SmolLM2-135M's sizes (30 layers of 576, 9 query and 3 KV
heads, an MLP of 1,536, 49,152 tokens) with a rank-16 PEFT adapter on every projection (q, k,
v, dense, fc1, fc2), 16 prompts of 64 random tokens -> 64 greedy tokens each, bf16, run on
the base model, on the adapter, and half and half, in the walk (--decoder-stack native) and
as modules, three rounds alternating; prints tokens per second.

    .venv/bin/python docs/results/issue17/milan30/lora_ungated.py > docs/results/issue17/milan30/lora_ungated.txt
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49_152, max_position_embeddings=4096, tie_word_embeddings=True,
             partial_rotary_factor=0.5)


def main() -> None:
    from helpers_lora import FAMILY_TARGETS, write_adapter
    from helpers_models import write_tiny_hf_model

    from kvloom import LLM, LoRARequest, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_hf_model(Path(tmp) / "phi", arch="phi", seed=0, **SHAPE)
        adapter = LoRARequest("a", 1, str(write_adapter(model, Path(tmp) / "adapter", 1, 16,
                                                        FAMILY_TARGETS["phi"][0])))
        rng = random.Random(0)
        prompts = [[rng.randrange(10, 40_000) for _ in range(64)] for _ in range(16)]
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        engines = {stack: LLM(str(model), dtype="bfloat16", enable_lora=True, max_lora_rank=16, num_blocks=512,
                              enable_prefix_caching=False, decoder_stack=stack) for stack in ("native", "modules")}
        loras = {"base": None, "adapter": adapter, "half": [adapter if i % 2 else None for i in range(16)]}
        for llm in engines.values():
            llm.generate(prompts[:2], SamplingParams(max_tokens=4), lora_request=adapter)  # warm-up, loads the slot
        for round_ in range(3):
            for stack, llm in engines.items():
                for name, lora in loras.items():
                    start = time.perf_counter()
                    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                    print(f"round {round_} {stack:8s} {name:8s} {tokens} tokens {seconds:6.2f} s "
                          f"({tokens / seconds:6.1f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
