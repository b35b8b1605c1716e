"""Gemma's, OLMo 2's and EXAONE 4's layers in the native walk against the modules (the
twenty-ninth session).

Writes random-weight models of Gemma 3 270M's shape (18 layers of 640, 4 query heads and
1 KV head of 256 dims, GeGLU of 2,048, a 262,144-token vocabulary, five windowed layers of
512 keys with their own rotary base to one full layer), of Gemma 2's layer kinds at the
same sizes (sandwich norms, windowed and full layers in turn, scores softcapped at 50), and
OLMo 2, EXAONE 4, StarCoder2, GPT-2, Phi, GPT-NeoX (Pythia), StableLM and OLMo 1 at
SmolLM2-135M's sizes (30 layers of 576, 9 query and 3 KV heads of 64 dims (GPT-2, Pythia: 9
of each), an MLP of 1,536, 49,152 tokens; EXAONE's three windowed layers of 512 keys to a
global one without rotary, StarCoder2's window of 512, OLMo 1's clip at 8), then
times bf16 engine steps in one process, the walk and the modules taking turns step by
step (`model.native_stack` set and cleared), so that both see the same hour and the same
contexts: decode at batch 1 / 16 / 64 from 300 tokens of context (STEPS steps each, default
40: half each way), and prefill steps of 4 fresh 256-token prompts (REPEATS each way,
default 4). Prints the median ms of each. MODELS=name,name runs those alone.

    .venv/bin/python docs/results/issue17/milan29/walk_families.py > docs/results/issue17/milan29/walk_families.txt
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, vocab_size=262_144, max_position_embeddings=4096,
             query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49_152, max_position_embeddings=4096, tie_word_embeddings=True)
MODELS = {
    "gemma3-270m-shape": dict(arch="gemma3", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, **SHAPE),
    "gemma2-kinds-270m-shape": dict(arch="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    **SHAPE),
    "olmo2-135m-shape": dict(arch="olmo2", **SMOLLM2),
    "exaone4-135m-shape": dict(arch="exaone4", head_dim=64, sliding_window=512, sliding_window_pattern=4, **SMOLLM2),
    "starcoder2-135m-shape": dict(arch="starcoder2", sliding_window=512, **SMOLLM2),
    "gpt2-135m-shape": dict(arch="gpt2", hidden_size=576, n_inner=1536, num_hidden_layers=30, num_attention_heads=9,
                            vocab_size=49_152, max_position_embeddings=1024, tie_word_embeddings=True),
    "phi-135m-shape": dict(arch="phi", partial_rotary_factor=0.5, **SMOLLM2),
    "pythia-135m-shape": dict(arch="gpt_neox", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, rotary_pct=0.25, vocab_size=49_152,
                              max_position_embeddings=4096, tie_word_embeddings=False),
    "stablelm-135m-shape": dict(arch="stablelm", partial_rotary_factor=0.25, **SMOLLM2),
    "olmo1-135m-shape": dict(arch="olmo", clip_qkv=8.0, **SMOLLM2),
}


def timed_step(engine: Any, stack: Any, native: bool) -> float:
    engine.model.native_stack = stack if native else None
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1000


def decode(engine: Any, stack: Any, batch: int, steps: int, rng: random.Random) -> dict[str, float]:
    from kvloom import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(10, 200) for _ in range(300)], params).request_id
           for _ in range(batch)]
    while any(request.num_computed_tokens < 300 for request in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps):
        native = step % 2 == 0
        times[native].append(timed_step(engine, stack, native))
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"modules": statistics.median(times[False]), "native": statistics.median(times[True])}


def prefill(engine: Any, stack: Any, repeats: int, rng: random.Random) -> dict[str, float]:
    from kvloom import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(2 * repeats):
        native = repeat % 2 == 0
        for _ in range(4):
            engine.add_request([rng.randrange(10, 200) for _ in range(256)], params)
        times[native].append(timed_step(engine, stack, native))
        while engine.has_unfinished_requests():
            engine.step()
    return {"modules": statistics.median(times[False]), "native": statistics.median(times[True])}


def main() -> None:
    from helpers_models import write_tiny_hf_model

    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    steps, repeats = int(os.environ.get("STEPS", "40")), int(os.environ.get("REPEATS", "4"))
    with tempfile.TemporaryDirectory() as tmp:
        chosen = os.environ.get("MODELS")
        for name, kwargs in MODELS.items():
            if chosen and name not in chosen.split(","):
                continue
            path = write_tiny_hf_model(Path(tmp) / name, seed=0, **kwargs)
            engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", num_blocks=1600,
                                                        max_num_seqs=64, max_num_batched_tokens=2048,
                                                        enable_prefix_caching=False, overlap_scheduling="off"))
            stack = engine.model.native_stack
            assert stack is not None, "the native walk does not serve this model"
            rng = random.Random(0)
            prefill(engine, stack, 1, rng)  # warm-up
            rows = {"prefill 4 x 256": prefill(engine, stack, repeats, rng)}
            for batch in (1, 16, 64):
                rows[f"decode b{batch} x 300"] = decode(engine, stack, batch, steps, rng)
            for shape, ms in rows.items():
                print(f"{name:24s} {shape:18s} modules {ms['modules']:8.2f} ms  native {ms['native']:8.2f} ms  "
                      f"{ms['modules'] / ms['native']:.2f}x", flush=True)
            engine.shutdown()


if __name__ == "__main__":
    main()
