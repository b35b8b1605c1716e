"""Decode steps of a random-weight IBM Granite (dense, with multipliers of Granite 3's
size) of the default model's size (SmolLM2-135M's shape: 30 layers, hidden 576, 9 query
and 3 KV heads of 64, MLP 1,536, vocabulary
49,152, tied head) in bf16, with the native decoder walk and with the module path
(``--decoder-stack``), alternating in one process; 16 or 1 requests of 300 random
prompt tokens (all computed in the first step), 30 decode steps each round, median of 3 rounds.

    .venv/bin/python docs/results/issue17/milan25/granite_steps.py [BATCH ...]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
             max_position_embeddings=2048, rms_norm_eps=1e-5,
             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0)


def write_model(path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path)
    sys.path.insert(0, str(Path(__file__).parents[4] / "tests"))
    from helpers_models import tiny_tokenizer_json
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(49152))
    (path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}')
    return path


def step_ms(engine: LLMEngine, batch: int, steps: int = 30) -> float:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(300)], params, request_id=f"{time.time()}-{i}")
    engine.step()  # the prompts
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [1, 16]
    path = write_model(Path(tempfile.mkdtemp()) / "granite")
    engines = {stack: LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", decoder_stack=stack,
                                                         enable_prefix_caching=False, max_num_batched_tokens=300 * max(batches)))
               for stack in ("native", "modules")}
    assert engines["native"].model.native_stack is not None and engines["modules"].model.native_stack is None
    for batch in batches:
        times: dict[str, list[float]] = {stack: [] for stack in engines}
        for _ in range(3):
            for stack, engine in engines.items():
                times[stack].append(step_ms(engine, batch))
        native, modules = (statistics.median(times[s]) for s in ("native", "modules"))
        print(f"batch {batch}: native walk {native:.2f} ms ({', '.join(f'{t:.2f}' for t in times['native'])}), "
              f"modules {modules:.2f} ms ({', '.join(f'{t:.2f}' for t in times['modules'])}): "
              f"{modules / native:.2f}x")


if __name__ == "__main__":
    main()
