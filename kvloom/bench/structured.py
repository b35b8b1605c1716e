"""Structured-output throughput: a JSON-schema workload against the same prompts
unconstrained, with jump-forward on and off, offline through ``LLMEngine``; and free
text under a structural tag (``tagged``: a strict tool under tool_choice auto, the
review as a call the model may open), whose greedy outputs are the free ones wherever
the model opens no call: what its mask costs a step.

``kvloom bench structured [MODEL] [engine flags] --num-prompts N --max-tokens N``
runs it (kvloom/bench/cli.py); from Python: ``run_structured_bench(engine, ...)`` and
``format_table(results)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.structured.constraint import StructuredOutput

# Fixed keys (forced by jump-forward) around short free values: a typical extraction task.
REVIEW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "would_recommend": {"type": "boolean"},
    },
    "required": ["product", "rating", "sentiment", "pros", "would_recommend"],
    "additionalProperties": False,
}

_PRODUCTS = ["a coffee grinder", "running shoes", "a mechanical keyboard", "a tent", "a blender",
             "noise-cancelling headphones", "a desk lamp", "a backpack", "an e-reader", "a kettle",
             "a yoga mat", "a drone", "a rice cooker", "a office chair", "a smartwatch", "a toaster"]

MODES = ("free", "json", "json+jump-forward", "tagged")


def tagged_constraint(schema: dict[str, Any]) -> StructuredOutput:
    """Free text in which ``<tool_call>`` opens a call whose arguments follow ``schema``
    (hermes's format, as ``auto_tool_call_constraint`` writes a strict tool's)."""
    from kvloom.structured.tool_grammar import auto_tool_call_constraint

    tool = {"type": "function", "function": {"name": "review", "parameters": schema, "strict": True}}
    constraint = auto_tool_call_constraint([tool], "hermes")
    assert constraint is not None
    return constraint


@dataclass(frozen=True)
class StructuredBenchResult:
    mode: str  # one of MODES
    num_requests: int
    output_tokens: int
    elapsed_s: float
    steps: int
    # json modes: outputs that parse and have every required key; tagged: outputs equal to
    # the free mode's (greedy: where the model opened no call); None for "free".
    num_valid: int | None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / max(1, self.steps)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_throughput": self.output_throughput,
                "requests_per_s": self.requests_per_s, "tokens_per_step": self.tokens_per_step}


def review_prompts(engine: LLMEngine, num_prompts: int) -> list[list[int]]:
    """Chat-templated prompts asking for a JSON review of a product."""
    prompts = []
    for index in range(num_prompts):
        product = _PRODUCTS[index % len(_PRODUCTS)]
        text = (f"Write a short review of {product} (customer #{index}) as a JSON object with the "
                "keys product, rating (1-5), sentiment, pros and would_recommend.")
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": text}]))
    return prompts


def run_structured_bench(engine: LLMEngine, num_prompts: int = 16, max_tokens: int = 128,
                         temperature: float = 0.0, seed: int = 0,
                         schema: dict[str, Any] | None = None) -> list[StructuredBenchResult]:
    """Time each mode over the same prompts, one batch each, on an idle ``engine``.

    An untimed warm-up first runs every prompt for one token (so a prefix cache, if
    enabled, is equally warm for every mode) and compiles the schema (compilation is
    cached per schema, so it is a one-time cost, not throughput).
    """
    schema = schema if schema is not None else REVIEW_SCHEMA
    prompts = review_prompts(engine, num_prompts)
    run_batch(engine, prompts, SamplingParams(max_tokens=1))
    run_batch(engine, prompts[:1], SamplingParams(max_tokens=4, structured=StructuredOutput(json_schema=schema)))
    run_batch(engine, prompts[:1], SamplingParams(max_tokens=4, structured=tagged_constraint(schema)))
    results: list[StructuredBenchResult] = []
    free_texts: list[str] = []
    for mode in MODES:
        structured = None if mode == "free" else tagged_constraint(schema) if mode == "tagged" else StructuredOutput(
            json_schema=schema, jump_forward=mode == "json+jump-forward")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                structured=structured)
        steps_before = engine.scheduler.step_count
        start = time.perf_counter()
        texts, output_tokens = run_batch(engine, prompts, params)
        elapsed = time.perf_counter() - start
        if mode == "free":
            free_texts, valid = sorted(texts), None
        elif mode == "tagged":
            valid = sum(a == b for a, b in zip(sorted(texts), free_texts, strict=True))
        else:
            valid = sum(_is_valid(text, schema) for text in texts)
        results.append(StructuredBenchResult(mode, len(prompts), output_tokens, elapsed,
                                             engine.scheduler.step_count - steps_before, valid))
    return results


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], int]:
    """Run every prompt under ``params`` to the end on an idle engine: the texts, the output tokens."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    texts, output_tokens = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                texts.append(output.outputs[0].text)
                output_tokens += len(output.outputs[0].token_ids)
    return texts, output_tokens


def _is_valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(schema.get("required", ())) <= value.keys()


def format_table(results: list[StructuredBenchResult]) -> str:
    header = (f"{'mode':<20}{'reqs':>6}{'out tok':>9}{'steps':>7}{'tok/step':>10}{'time s':>9}"
              f"{'out tok/s':>11}{'req/s':>8}{'valid':>8}")  # tagged: "valid" counts outputs equal to free
    lines = [header, "-" * len(header)]
    for r in results:
        valid = "-" if r.num_valid is None else f"{r.num_valid}/{r.num_requests}"
        lines.append(f"{r.mode:<20}{r.num_requests:>6}{r.output_tokens:>9}{r.steps:>7}"
                     f"{r.tokens_per_step:>10.2f}{r.elapsed_s:>9.2f}{r.output_throughput:>11.1f}"
                     f"{r.requests_per_s:>8.2f}{valid:>8}")
    return "\n".join(lines)
