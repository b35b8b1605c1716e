"""kvloom.lang programs: the SGLang paper's workloads that fit a CPU, and a timer.

    python examples/lang_programs.py                     # every workload, radix cache on
    python examples/lang_programs.py --no-prefix-cache   # the same with it off
    python examples/lang_programs.py --workload few_shot --endpoint http://127.0.0.1:8000

Each run prints one JSON line per workload: wall time, programs per second, output
tokens per second, the prefix-cache hit rate (the engine's counters in-process, the
server's /metrics with --endpoint) and, for multi_turn, each turn's time to first text.
examples/openai_calls.py runs the same logic as independent OpenAI calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

import kvloom.lang as kl

EXAMPLES = [("The package arrived broken.", "negative"), ("Fast delivery, great price!", "positive"),
            ("It works, I suppose.", "neutral"), ("Terrible support, never again.", "negative"),
            ("Exactly what I wanted.", "positive")]
QUESTIONS = ["The battery died after a day.", "Lovely colours and soft fabric.", "It is a chair.",
             "Arrived late but works well.", "Broke on first use.", "Best purchase this year.",
             "Average quality for the price.", "I returned it immediately."]


@kl.function
def few_shot(s, review: str) -> None:
    """Classification with five shared examples: every program's prompt starts the same."""
    s += "Classify the sentiment of each review.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: " + kl.select("label", ["positive", "negative", "neutral"])


@kl.function
def tree_of_thought(s, question: str) -> None:
    """Three ideas, then three refinements of each (2 levels, 12 generations). Every
    gen is queued before any result is read, so all that can run at once does: a
    fork waits only for its parent's text."""
    s += kl.system("You think step by step.")
    s += kl.user(f"{question} Propose an approach.")
    ideas = s.fork(3)
    for i, idea in enumerate(ideas):
        idea += kl.assistant(f"Approach {i + 1}: " + kl.gen("idea", max_tokens=24, temperature=0.8))
    refinements = []
    for idea in ideas:
        refinements.append(idea.fork(3))
        for j, refined in enumerate(refinements[-1]):
            refined += kl.user(f"Refine it ({j + 1}).") + kl.assistant(kl.gen("refined", max_tokens=24,
                                                                               temperature=0.8))
    s["ideas"] = [{"idea": idea["idea"], "refined": [r["refined"] for r in forks]}
                  for idea, forks in zip(ideas, refinements, strict=True)]


@kl.function
def multi_turn(s, topic: str) -> None:
    """Four turns of one conversation: each turn's prompt is the previous one's, longer."""
    s += kl.system("You are a concise assistant.")
    for turn in range(4):
        s += kl.user(f"Tell me one more fact about {topic} (fact {turn + 1}).")
        s += kl.assistant(kl.gen(f"answer{turn}", max_tokens=32))


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@kl.function
def json_extraction(s, text: str) -> None:
    s += kl.system("You extract data as JSON.")
    s += kl.user(f"Extract the person as JSON (name, age, city): {text}")
    s += kl.assistant(kl.gen("person", max_tokens=96, json_schema=PERSON))


WORKLOADS: dict[str, tuple[kl.Function, Callable[[int], list[dict[str, Any]]]]] = {
    "few_shot": (few_shot, lambda n: [{"review": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"} for i in range(n)]),
    "tree_of_thought": (tree_of_thought, lambda n: [{"question": f"How do I sort {i + 10} books?"}
                                                    for i in range(n)]),
    "multi_turn": (multi_turn, lambda n: [{"topic": t} for t in (["rivers", "owls", "glass", "tea"] * n)[:n]]),
    "json_extraction": (json_extraction, lambda n: [{"text": f"Ana Silva, {20 + i}, lives in Porto."}
                                                    for i in range(n)]),
}
SIZES = {"few_shot": 64, "tree_of_thought": 4, "multi_turn": 16, "json_extraction": 16}
TURNS = 4


def server_counters(base_url: str) -> dict[str, float]:
    """The kvloom server's token counters (its /metrics), to difference around a run.
    Prompt tokens computed: those admitted less those the cache served."""
    names = {"kvloom:prompt_tokens": "prompt", "kvloom:generation_tokens": "generated",
             "kvloom:prefix_cache_queries": "queried", "kvloom:prefix_cache_hits": "hit"}
    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30.0).text
    found = {names[f.name]: sum(x.value for x in f.samples if x.name.endswith("_total"))
             for f in text_string_to_metric_families(text) if f.name in names}
    return {"computed": found["prompt"] - found["hit"], "generated": found["generated"],
            "queried": found["queried"], "hit": found["hit"]}


def engine_counters(engine: Any) -> dict[str, float]:
    """The same counters from an in-process engine."""
    stats = engine.stats()
    return {"computed": stats.num_prompt_tokens, "generated": stats.num_generation_tokens,
            "queried": stats.prefix_cache_queried_tokens, "hit": stats.prefix_cache_hit_tokens}


def token_figures(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    change = {key: after[key] - before[key] for key in after}
    return {"output_tok_per_s": round(change["generated"] / seconds, 1),
            "prompt_tokens_computed": int(change["computed"]),
            "cache_hit_rate": round(change["hit"] / max(1.0, change["queried"]), 3)}


def ttft_by_turn(first_text_s: list[list[float | None]]) -> list[float]:
    """Median time to first text of each turn over the conversations, in ms."""
    turns = zip(*first_text_s, strict=True)
    return [round(1000 * statistics.median(t for t in turn if t is not None), 1) for turn in turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--endpoint", default=None, help="a kvloom serve URL instead of an in-process LLM")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--num", type=int, default=None, help="programs per workload")
    args = parser.parse_args()
    engine = None
    if args.endpoint:
        backend: kl.Backend = kl.Endpoint(args.endpoint)
    else:
        from kvloom import LLM
        from kvloom.config import DEFAULT_MODEL
        llm = LLM(args.model or DEFAULT_MODEL, enable_prefix_caching=not args.no_prefix_cache)
        engine = llm.engine
        backend = kl.Local(llm)

    def counters() -> dict[str, float]:
        return engine_counters(engine) if engine is not None else server_counters(args.endpoint)

    for name in WORKLOADS if args.workload == "all" else [args.workload]:
        program, inputs = WORKLOADS[name]
        batch = inputs(args.num or SIZES[name])
        before = counters()
        started = time.perf_counter()
        states = program.run_batch(batch, backend=backend)
        seconds = time.perf_counter() - started
        result: dict[str, Any] = {"workload": name, "style": "program",
                                  "backend": "endpoint" if args.endpoint else "local", "programs": len(batch),
                                  "seconds": round(seconds, 2), "programs_per_s": round(len(batch) / seconds, 3),
                                  **token_figures(before, counters(), seconds)}
        if args.endpoint is None:
            result["prefix_cache"] = not args.no_prefix_cache
        if name == "multi_turn":
            result["ttft_ms_by_turn"] = ttft_by_turn([[c.first_text_s for c in state.calls] for state in states])
        print(json.dumps(result), flush=True)

if __name__ == "__main__":
    main()
