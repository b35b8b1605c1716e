"""Function calling with and without the grammar: the same prompts (the tools described
in the system prompt, as Qwen's template writes them for the hermes format), answered
freely and parsed, or forced by ``tool_choice`` "required" (one call, arguments under
the function's schema), offline through ``LLMEngine``.

``kvloom bench tools [MODEL] [engine flags] --num-prompts N --max-tokens N``; reports per
mode the calls that parse and validate against the schema, and the throughput.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvloom.bench.extras import require_bench_package
from kvloom.bench.structured import run_batch
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import SamplingParams
from kvloom.server.tool_parsers import get_tool_parser
from kvloom.structured.tool_grammar import tool_call_constraint

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
FLIGHTS = {"type": "object", "properties": {
    "origin": {"type": "string", "maxLength": 32}, "destination": {"type": "string", "maxLength": 32},
    "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["origin", "destination", "passengers"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two cities",
                                      "parameters": FLIGHTS}},
]
_ASKS = ["What is the weather in {a}, in celsius?", "Find flights from {a} to {b} for 2 people.",
         "Is it cold in {b} right now? Answer in fahrenheit.", "I need a flight from {b} to {a}, just me."]
_CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Perth", "Quito", "Dublin"]
MODES = ("free", "required")


@dataclass(frozen=True)
class ToolBenchResult:
    mode: str  # one of MODES
    num_requests: int
    num_valid: int  # responses with at least one call, every call valid under its schema
    output_tokens: int
    elapsed_s: float
    steps: int  # engine steps the batch took (jump-forward appends forced tokens without one)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def ms_per_step(self) -> float:
        """The constraint's cost where it shows: the time of a step (mask, matcher advance)."""
        return 1000 * self.elapsed_s / max(1, self.steps)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_throughput": self.output_throughput, "ms_per_step": self.ms_per_step}


def system_prompt(tools: list[dict[str, Any]]) -> str:
    described = "\n".join(json.dumps(tool) for tool in tools)
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{described}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def prompts(engine: LLMEngine, num_prompts: int) -> list[list[int]]:
    system = system_prompt(TOOLS)
    result = []
    for index in range(num_prompts):
        ask = _ASKS[index % len(_ASKS)].format(a=_CITIES[index % len(_CITIES)],
                                               b=_CITIES[(index * 3 + 1) % len(_CITIES)])
        result.append(engine.tokenizer.encode_chat([{"role": "system", "content": system},
                                                    {"role": "user", "content": ask}]))
    return result


def run_tool_call_bench(engine: LLMEngine, num_prompts: int = 16, max_tokens: int = 96,
                        temperature: float = 0.0, seed: int = 0) -> list[ToolBenchResult]:
    """Each mode over the same prompts, one batch each, after an untimed warm-up (every
    prompt for one token, and the grammar compiled once)."""
    batch = prompts(engine, num_prompts)
    constraint = tool_call_constraint(TOOLS, "required", "hermes", parallel=False)
    run_batch(engine, batch, SamplingParams(max_tokens=1))
    run_batch(engine, batch[:1], SamplingParams(max_tokens=2, structured=constraint))
    results = []
    for mode in MODES:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                structured=constraint if mode == "required" else None)
        steps_before = engine.scheduler.step_count
        start = time.perf_counter()
        texts, output_tokens = run_batch(engine, batch, params)
        elapsed = time.perf_counter() - start
        results.append(ToolBenchResult(mode, len(batch), sum(map(valid_calls, texts)), output_tokens, elapsed,
                                       engine.scheduler.step_count - steps_before))
    return results


def valid_calls(text: str) -> bool:
    """The output parses (hermes) into at least one call, each valid under its function's schema."""
    require_bench_package("jsonschema", "bench tools (validating the calls)")
    import jsonschema
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    _, calls = get_tool_parser("hermes").parse(text)
    if not calls:
        return False
    for call in calls:
        if call.name not in schemas:
            return False
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except jsonschema.ValidationError:
            return False
    return True


def format_table(results: list[ToolBenchResult]) -> str:
    header = (f"{'mode':<10}{'reqs':>6}{'valid calls':>13}{'out tok':>9}{'steps':>7}{'ms/step':>9}"
              f"{'time s':>9}{'out tok/s':>11}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r.mode:<10}{r.num_requests:>6}{f'{r.num_valid}/{r.num_requests}':>13}"
                     f"{r.output_tokens:>9}{r.steps:>7}{r.ms_per_step:>9.1f}{r.elapsed_s:>9.2f}"
                     f"{r.output_throughput:>11.1f}")
    return "\n".join(lines)
