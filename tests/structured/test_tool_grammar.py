"""The enforced tool-call grammar: hand-written outputs accepted / rejected by llguidance
(wrong name, arguments against the schema, missing markers, extra calls), bad inputs
named, and sampled generations on a tiny random model that always parse into calls
whose arguments validate against the function's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.server.tool_parsers import get_tool_parser
from kvloom.structured.compiler import GrammarCompiler
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.tool_grammar import auto_tool_call_constraint, calls_or_output, tool_call_constraint
from kvloom.tokenizer import Tokenizer

WEATHER = {  # bounded, so even a random-weight model finishes it
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "exact": {"type": "boolean"}},
    "required": ["id", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "description": "find a record", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: only {}
]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP, "ping": {"type": "object", "maxProperties": 0}}


def written(parser_name: str, calls: list[tuple[str, str]], compact: bool = False) -> str:
    """Calls (name, compact arguments JSON) written the way the grammar writes them
    (``compact``: llama3_json's whole call as compact JSON, as a JSON schema writes it)."""
    if compact:
        return "; ".join(f'{{"name":"{name}","parameters":{arguments}}}' for name, arguments in calls)
    if parser_name == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
                         for name, arguments in calls)
    if parser_name == "llama3_json":
        return "; ".join(f'{{"name": "{name}", "parameters": {arguments}}}' for name, arguments in calls)
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{name}", "arguments": {arguments}}}'
                                       for name, arguments in calls) + "]"


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    tokenizer = Tokenizer.from_file(tiny_llama / "tokenizer.json")
    return GrammarCompiler(tokenizer, vocab_size=512, eos_token_ids=[2])


def accepts(compiler: GrammarCompiler, constraint, text: str) -> bool:
    """Whether the grammar takes exactly ``text`` as a complete output."""
    matcher = compiler.compile(constraint).new_matcher()
    return matcher.consume_tokens(compiler.ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


WEATHER_CALL = ("get_weather", '{"city":"Oslo","days":3}')
LOOKUP_CALL = ("lookup", '{"id":42,"exact":false}')
PING_CALL = ("ping", "{}")
PARSERS = ["hermes", "llama3_json", "mistral"]


@pytest.mark.parametrize("parser_name", PARSERS)
def test_required_accepts_valid_calls_and_rejects_invalid_ones(compiler, parser_name) -> None:
    single = tool_call_constraint(TOOLS, "required", parser_name, parallel=False)
    parallel = tool_call_constraint(TOOLS, "required", parser_name, parallel=True)
    for call in (WEATHER_CALL, LOOKUP_CALL, PING_CALL):
        assert accepts(compiler, single, written(parser_name, [call]))
        assert accepts(compiler, parallel, written(parser_name, [call]))
    assert accepts(compiler, parallel, written(parser_name, [WEATHER_CALL, LOOKUP_CALL, WEATHER_CALL]))
    rejected = [
        written(parser_name, [WEATHER_CALL, LOOKUP_CALL]),  # two calls without parallel
        written(parser_name, [("get_wether", WEATHER_CALL[1])]),  # not a tool
        written(parser_name, [("get_weather", '{"city":"Rome","days":3}')]),  # not in the enum
        written(parser_name, [("get_weather", '{"city":"Oslo","days":9}')]),  # above maximum
        written(parser_name, [("get_weather", '{"city":"Oslo"}')]),  # required property missing
        written(parser_name, [("lookup", '{"id":"42","exact":false}')]),  # wrong type
        written(parser_name, [("ping", '{"x":1}')]),  # no parameters allowed
        written(parser_name, [LOOKUP_CALL])[:-1],  # incomplete
        "Sure! " + written(parser_name, [LOOKUP_CALL]),  # text before the call
        # no markers (hermes, mistral) / "arguments" for "parameters" (llama3_json)
        '{"name": "lookup", "arguments": {"id":42,"exact":false}}',
        "",
    ]
    for text in rejected:
        assert not accepts(compiler, single, text), text


@pytest.mark.parametrize("parser_name", PARSERS)
def test_named_function_allows_only_that_function_once(compiler, parser_name) -> None:
    named = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "lookup"}},
                                 parser_name, parallel=True)
    assert accepts(compiler, named, written(parser_name, [LOOKUP_CALL]))
    assert not accepts(compiler, named, written(parser_name, [WEATHER_CALL]))
    assert not accepts(compiler, named, written(parser_name, [LOOKUP_CALL, LOOKUP_CALL]))


def test_arguments_are_compact_json(compiler) -> None:
    constraint = tool_call_constraint(TOOLS, "required", "hermes", parallel=False)
    assert not accepts(compiler, constraint, written("hermes", [("lookup", '{"id": 42, "exact": false}')]))


def test_accepted_text_parses_into_the_calls(compiler) -> None:
    for parser_name in PARSERS:
        text = written(parser_name, [WEATHER_CALL, LOOKUP_CALL])
        assert accepts(compiler, tool_call_constraint(TOOLS, "required", parser_name), text)
        content, calls = get_tool_parser(parser_name).parse(text)
        assert content is None
        assert [(call.name, json.loads(call.arguments)) for call in calls] == [
            ("get_weather", {"city": "Oslo", "days": 3}), ("lookup", {"id": 42, "exact": False})]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tool_choice="auto"), "tool_choice must be 'none', 'auto', 'required' or .*; 'auto' forces no call"),
    (dict(tool_choice="none"), "; 'none' forces no call"),
    (dict(tool_choice="sometimes"), "tool_choice must be 'none', 'auto', 'required' or .*; 'sometimes'"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name 'nope' is not in tools"),
    (dict(tool_choice={"type": "function"}), "tool_choice.function.name must be a string"),
    (dict(tool_choice=["required"]), "tool_choice must be 'none', 'auto', 'required'"),
    (dict(parser_name="pythonic"), r"a forced call \(tool_choice 'required' or a named function\) needs a "
                                   r"tool_call_parser whose calls a grammar can write "
                                   r"\(hermes, llama3_json, mistral\); 'pythonic' has none"),
    (dict(parser_name="openai"), "'openai' has none"),  # GPT-OSS's harmony calls: read, never written
    (dict(tools=[]), "tools must be a non-empty list"),
    (dict(tools=[{"type": "retrieval"}]), r"tools\[0\].type must be 'function'"),
    (dict(tools=[{"type": "function"}]), r"tools\[0\].function must be an object"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), r"tools\[0\].function.name must match"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), r"tools\[1\].function.name 'get_weather' is given twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     r"tools\[0\].function.parameters must be a JSON schema object"),
])
def test_bad_inputs_name_the_field(kwargs, message) -> None:
    args = dict(tools=TOOLS, tool_choice="required", parser_name="hermes", parallel=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tool_call_constraint(**args)


def test_invalid_parameters_schema_fails_at_compile(compiler) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(ValueError, match="invalid grammar: .*strin"):
        compiler.compile(tool_call_constraint(tools, "required", "hermes"))


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, *TOOLS[1:]]
BAD_WEATHER_CALL = ("get_weather", '{"city":"Rome","days":3}')  # not in the enum
ANY_LOOKUP_CALL = ("lookup", '{"anything":[1]}')  # any object: lookup is not strict


def _in_text(parser_name: str, calls: list[tuple[str, str]]) -> str:
    """Calls where a parser reads them in free output: after text (at the start for llama3_json)."""
    return written(parser_name, calls) if parser_name == "llama3_json" else \
        "Let me look. " + written(parser_name, calls)


@pytest.mark.parametrize("parser_name", PARSERS)
def test_auto_with_a_strict_tool_holds_every_call_the_model_opens(compiler, parser_name) -> None:
    """tool_choice auto with a strict tool: free text, and whole calls where the parser
    reads them, a strict tool's arguments under its schema, another tool's any object;
    what it accepts the parser reads back as those calls."""
    parallel = auto_tool_call_constraint(STRICT_TOOLS, parser_name)
    single = auto_tool_call_constraint(STRICT_TOOLS, parser_name, parallel=False)
    for constraint in (parallel, single):
        for text in ("It is sunny in Oslo.", "", _in_text(parser_name, [WEATHER_CALL]),
                     _in_text(parser_name, [ANY_LOOKUP_CALL])):
            assert accepts(compiler, constraint, text), text
        for text in (_in_text(parser_name, [BAD_WEATHER_CALL]), _in_text(parser_name, [("get_wether", "{}")]),
                     _in_text(parser_name, [WEATHER_CALL])[:-1] if parser_name != "hermes" else "x <tool_call>{}"):
            assert not accepts(compiler, constraint, text), text
    two = _in_text(parser_name, [WEATHER_CALL, LOOKUP_CALL])
    assert accepts(compiler, parallel, two) and not accepts(compiler, single, two)
    content, calls = get_tool_parser(parser_name).parse(two)
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}), ("lookup", {"id": 42, "exact": False})]


def test_auto_constrains_by_the_tools_strict_flags_and_the_level(compiler) -> None:
    """vLLM's levels: "auto" constrains nothing without a strict tool; "function" every
    call's envelope (any arguments); "parameter" every tool's arguments too."""
    assert auto_tool_call_constraint(TOOLS, "hermes") is None
    function_level = auto_tool_call_constraint(TOOLS, "hermes", strict_level="function")
    parameter_level = auto_tool_call_constraint(TOOLS, "hermes", strict_level="parameter")
    bad = _in_text("hermes", [BAD_WEATHER_CALL])
    assert accepts(compiler, function_level, bad) and not accepts(compiler, parameter_level, bad)
    unknown = _in_text("hermes", [("get_wether", "{}")])
    assert not accepts(compiler, function_level, unknown)
    # llama3_json reads a call at the start, so text may not start as one would.
    llama = auto_tool_call_constraint(TOOLS, "llama3_json", strict_level="function")
    assert not accepts(compiler, llama, ' {"name": "lookup"}') and not accepts(compiler, llama, "{x")
    with pytest.raises(ValueError, match="tool_strict_level must be one of auto, function, parameter"):
        auto_tool_call_constraint(TOOLS, "hermes", strict_level="always")
    with pytest.raises(ValueError, match=r"tools\[0\].function.strict must be a bool"):
        auto_tool_call_constraint([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "hermes")


@pytest.mark.parametrize("parser_name", PARSERS)
def test_strict_calls_with_a_response_format_are_calls_or_that_answer(compiler, parser_name) -> None:
    """vLLM's rule for tool_choice auto with strict tools and a response_format: the
    output is only calls (as "required" writes them) or the format's answer, nothing
    else; without a strict tool the format alone applies (None)."""
    answer = StructuredOutput(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"], "additionalProperties": False})
    either = calls_or_output(STRICT_TOOLS, parser_name, "auto", True, answer)
    assert either is not None
    compact = parser_name == "llama3_json"  # its calls are JSON objects, written compact
    for text in (written(parser_name, [WEATHER_CALL], compact), written(parser_name, [WEATHER_CALL, ANY_LOOKUP_CALL],
                                                                          compact), '{"ok":true}'):
        assert accepts(compiler, either, text), text
    for text in ("It is sunny.", "Sure. " + written(parser_name, [WEATHER_CALL], compact),
                 written(parser_name, [BAD_WEATHER_CALL], compact), '{"ok":1}',
                 written(parser_name, [WEATHER_CALL], compact) + " ok"):
        assert not accepts(compiler, either, text), text
    single = calls_or_output(STRICT_TOOLS, parser_name, "auto", False, StructuredOutput(choice=["yes", "no"]))
    assert accepts(compiler, single, "no") and accepts(compiler, single, written(parser_name, [LOOKUP_CALL], compact))
    assert not accepts(compiler, single, written(parser_name, [LOOKUP_CALL, LOOKUP_CALL], compact))
    for text in (written(parser_name, [WEATHER_CALL, LOOKUP_CALL], compact),):  # the parser reads them back
        _, calls = get_tool_parser(parser_name).parse(text)
        assert [call.name for call in calls] == ["get_weather", "lookup"]
    assert calls_or_output(TOOLS, parser_name, "auto", True, answer) is None


@pytest.mark.parametrize("parser_name", PARSERS)
@pytest.mark.parametrize("parallel", [False, True])
def test_sampled_generations_parse_into_valid_calls(tiny_llama, parser_name, parallel) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", block_size=8, num_blocks=512))
    constraint = tool_call_constraint(TOOLS, "required", parser_name, parallel=parallel)
    rng = random.Random(7)
    for seed in range(6):
        prompt = [rng.randrange(3, 512) for _ in range(12)]
        engine.add_request(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                                                  structured=constraint), request_id=f"r{seed}")
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    names, counts = [], []
    for completion in finals.values():
        assert completion.finish_reason == "stop", completion.text
        content, calls = get_tool_parser(parser_name).parse(completion.text)
        assert content is None and calls, completion.text
        assert parallel or len(calls) == 1
        counts.append(len(calls))
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            names.append(call.name)
    assert len(finals) == 6
    # the samples differ: several functions, and several calls in some when parallel
    assert len(set(names)) > 1 and (not parallel or max(counts) > 1)


def test_the_tool_call_bench_forces_valid_calls(tmp_path) -> None:
    """kvloom bench tools on a tiny random model (a context long enough for the tools'
    system prompt): the grammar's mode always calls validly; valid_calls agrees with
    hand-written outputs."""
    from helpers_models import write_tiny_hf_model

    from kvloom.bench.tool_calls import MODES, format_table, run_tool_call_bench, valid_calls
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine

    model = write_tiny_hf_model(tmp_path / "tiny", max_position_embeddings=2048)
    engine = LLMEngine(EngineConfig.from_kwargs(str(model), dtype="float32", block_size=16, num_blocks=512))
    results = run_tool_call_bench(engine, num_prompts=3, max_tokens=200)  # a small vocabulary: many tokens
    assert [r.mode for r in results] == list(MODES)
    required = results[1]
    assert required.num_valid == required.num_requests == 3
    assert "3/3" in format_table(results)
    assert valid_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
                       "</tool_call>")
    assert not valid_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}'
                           "\n</tool_call>")
    assert not valid_calls("It is sunny in Oslo.")
