"""A cross-encoder's rerank with and without the prefix cache: one query of 256 tokens
against 64 documents of 64-128 tokens, each pair one input (query first), so the radix
cache serves the query's KV to every pair after the first. A random-weight
Qwen3ForSequenceClassification of the default model's size (30 layers, hidden 576,
9 / 3 heads of 64, one label), bf16, on this CPU; three alternating rounds, median.

    .venv/bin/python docs/results/issue17/milan24/rerank_prefix.py
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from helpers_models import write_tiny_hf_model  # noqa: E402

from kvloom import LLM  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = write_tiny_hf_model(Path(directory), arch="qwen3_classifier", num_labels=1, hidden_size=576,
                                   intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, vocab_size=49152)
        rng = random.Random(0)
        query = [rng.randrange(3, 49000) for _ in range(256)]
        documents = [[rng.randrange(3, 49000) for _ in range(rng.randrange(64, 129))] for _ in range(64)]
        engines = {cached: LLM(str(path), dtype="bfloat16", kv_cache_memory=1.0, enable_prefix_caching=cached)
                   for cached in (True, False)}
        times: dict[bool, list[float]] = {True: [], False: []}
        scores: dict[bool, list[float]] = {}
        for _ in range(3):
            for cached, llm in engines.items():
                llm.reset_prefix_cache()
                started = time.perf_counter()
                scored = llm.score([query], documents, use_tqdm=False)  # token ids: query, then document
                times[cached].append(time.perf_counter() - started)
                scores[cached] = [output.outputs.score for output in scored]
        tokens = sum(len(query) + len(document) for document in documents)
        for cached in (False, True):
            median = statistics.median(times[cached])
            print(f"prefix cache {'on ' if cached else 'off'}: {median:.2f} s for 64 pairs ({tokens} prompt tokens), "
                  f"{64 / median:.1f} pairs/s; rounds {', '.join(f'{t:.2f}' for t in times[cached])}")
        same = scores[True] == scores[False]
        print(f"scores equal bit for bit with and without the cache: {same}")


if __name__ == "__main__":
    main()
