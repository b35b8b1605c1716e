"""Decode steps of random-weight models of the default model's size (SmolLM2-135M's shape:
30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP 1,536, vocabulary 49,152, tied head)
in bf16, one per family named on the command line, each as kvloom serves it (the native walk
where the family has it) and, for the families the walk runs, as modules too; 1 and 16 requests
of 300 random prompt tokens (computed in the first step), 30 decode steps a round, median of 3
rounds, the engines alternating in one process.

    .venv/bin/python docs/results/issue17/milan27/family_steps.py llama smollm3 ernie4_5 phi stablelm gpt_neox
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

sys.path.insert(0, str(Path(__file__).parents[4] / "tests"))
from helpers_models import _ARCH_CONFIGS, tiny_tokenizer_json  # noqa: E402

from kvloom import SamplingParams  # noqa: E402
from kvloom.config import EngineConfig  # noqa: E402
from kvloom.engine.engine import LLMEngine  # noqa: E402

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=0)


def write_model(path: Path, arch: str) -> Path:
    config_name, model_name = _ARCH_CONFIGS[arch]
    torch.manual_seed(0)
    extra = {"num_key_value_heads": 9} if arch == "gpt_neox" else {}  # (NeoX has a KV head per head)
    config = getattr(transformers, config_name)(**{**SHAPE, **extra})
    getattr(transformers, model_name)(config).to(torch.bfloat16).save_pretrained(path)
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
    engines: dict[str, LLMEngine] = {}
    root = Path(tempfile.mkdtemp())
    for arch in sys.argv[1:] or ["llama", "smollm3"]:
        path = write_model(root / arch, arch)
        native = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", enable_prefix_caching=False,
                                                    max_num_batched_tokens=300 * 16))
        engines[arch] = native
        if native.model.native_stack is not None:
            engines[f"{arch} (modules)"] = LLMEngine(EngineConfig.from_kwargs(
                str(path), dtype="bfloat16", decoder_stack="modules", enable_prefix_caching=False,
                max_num_batched_tokens=300 * 16))
    for batch in (1, 16):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(3):
            for name, engine in engines.items():
                times[name].append(step_ms(engine, batch))
        for name, values in times.items():
            walk = "native walk" if engines[name].model.native_stack is not None else "modules"
            print(f"batch {batch:2d}  {name:22s} {walk:11s} {statistics.median(values):7.2f} ms "
                  f"({', '.join(f'{t:.2f}' for t in values)})", flush=True)


if __name__ == "__main__":
    main()
