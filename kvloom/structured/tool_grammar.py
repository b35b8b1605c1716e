"""The grammar of tool calls: forced ones, and strict ones the model chooses to make.

``tool_call_constraint`` (``tool_choice`` "required" or a named function) builds a
Lark grammar (llguidance dialect) that forces the output into a tool-call parser's
format, with each function's arguments generated under its JSON schema
(``%json{...}``), so the parser of the same name (``kvloom.server.tool_parsers``)
always finds valid calls in it. ``auto_tool_call_constraint`` (``tool_choice`` "auto"
with a ``strict`` tool, or a server strict level: vLLM's) leaves the output free text
but makes every call the model opens a whole call in that format (a structural tag:
the parser's marker is its trigger), with the arguments of strict tools under their
schemas. Pure Python: the schemas are checked by llguidance when the engine compiles
the constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvloom.structured.constraint import StructuredOutput, structural_tag_format

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# A function without "parameters" takes none (OpenAI: "omitting parameters defines a
# function with an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class InvalidTools(ValueError):
    """Malformed ``tools``; ``param`` names the field (``tools[2]``), as OpenAI's errors do."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class _Format:
    """How a parser's format writes calls: ``prefix (call (separator call)*) suffix``,
    each call ``call_open {"name": ..., "<arguments_key>": <args>} call_close``."""

    prefix: str
    call_open: str
    call_close: str
    separator: str
    suffix: str
    arguments_key: str


TOOL_CALL_FORMATS: dict[str, _Format] = {
    "hermes": _Format("", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments"),
    # <|python_tag|> and [TOOL_CALLS] are optional / plain text to the parsers, so the
    # grammar needs no special token (which a tokenizer may lack).
    "llama3_json": _Format("", "", "", "; ", "", "parameters"),
    "mistral": _Format("[TOOL_CALLS][", "", "", ", ", "]", "arguments"),
}


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any],
                         parser_name: str, parallel: bool = True) -> StructuredOutput:
    """A constraint under which the output is one call (or, with ``parallel``, one or
    more calls) of the allowed functions, written in ``parser_name``'s format.

    tools: OpenAI ``tools`` (``[{"type": "function", "function": {"name", "parameters"}}]``).
    tool_choice: "required" (any of ``tools``) or ``{"type": "function", "function":
        {"name": ...}}`` (exactly one call of that function; ``parallel`` is ignored).
    Raises ValueError naming the field for malformed tools, an unknown parser, a named
    function not in ``tools``, or a tool_choice ("auto", "none") that forces nothing.
    """
    output_format = _output_format(parser_name, "a forced call (tool_choice 'required' or a named function)")
    functions = tool_functions(tools)
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                             f'{{"type": "function", "function": {{"name": ...}}}}; {tool_choice!r} '
                             "forces no call")
        allowed = functions
    else:
        name = _named_choice(tool_choice)
        if name not in functions:
            raise ValueError(f"tool_choice.function.name {name!r} is not in tools "
                             f"({', '.join(functions)})")
        allowed = {name: functions[name]}
        parallel = False
    return StructuredOutput(grammar=_grammar(allowed, output_format, parallel))


# vLLM's --tool-strict-level: what tool_choice "auto" constrains. "auto": nothing, unless
# a tool sets "strict": true (then every call's envelope, and the arguments of the strict
# tools); "function": every call's envelope, whatever the tools say; "parameter": the
# envelope and every tool's arguments (each tool as if strict).
TOOL_STRICT_LEVELS = ("auto", "function", "parameter")
# Any JSON object: the arguments of a tool that is not strict.
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


def auto_tool_call_constraint(tools: Sequence[Mapping[str, Any]], parser_name: str, strict_level: str = "auto",
                              parallel: bool = True) -> StructuredOutput | None:
    """The constraint of tool_choice "auto", or None where nothing is constrained (no
    tool is strict and the level is "auto"). The output stays free text; each call
    the model opens is a whole call of one of ``tools`` in ``parser_name``'s format
    (one at most without ``parallel``). Raises ValueError as ``tool_call_constraint``."""
    held = _held_calls(tools, parser_name, strict_level)
    if held is None:
        return None
    output_format, schemas = held
    calls = [_call_tag(name, schema, output_format) for name, schema in schemas.items()]
    return StructuredOutput(structural_tag={"type": "structural_tag",
                                            "format": _auto_format(calls, output_format, parallel)})


def calls_or_output(tools: Sequence[Mapping[str, Any]], parser_name: str, strict_level: str, parallel: bool,
                    output: StructuredOutput) -> StructuredOutput | None:
    """tool_choice "auto" with strict tools and a constraint of the request's own
    (``response_format``, vLLM's rule): the output is either calls (one or more, in
    ``parser_name``'s format, only calls) or the constrained answer. None where nothing is
    strict (``output`` alone applies)."""
    held = _held_calls(tools, parser_name, strict_level)
    if held is None:
        return None
    output_format, schemas = held
    # A call that is a bare JSON object (llama3_json) is written as one JSON schema: an
    # answer that is JSON too starts with the same "{", and llguidance's lexer cannot
    # hold a literal call head and a JSON value open side by side (it takes the longer).
    calls = ([_json_call(name, schema, output_format) for name, schema in schemas.items()]
             if not output_format.call_open and not output_format.prefix
             else [_call_tag(name, schema, output_format) for name, schema in schemas.items()])
    listed = {"type": "tags_with_separator", "tags": calls, "separator": output_format.separator,
              "at_least_one": True, "stop_after_first": not parallel}
    around = [{"type": "const_string", "value": text} for text in (output_format.prefix,) if text]
    after = [{"type": "const_string", "value": text} for text in (output_format.suffix,) if text]
    only_calls = {"type": "sequence", "elements": [*around, listed, *after]} if around or after else listed
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": {
        "type": "or", "elements": [only_calls, _as_format(output)]}}, jump_forward=output.jump_forward)


def _output_format(parser_name: str, needed_for: str) -> _Format:
    """The grammar's format of ``parser_name``'s calls; ValueError where it has none (a
    parser kvloom only reads: GPT-OSS's ``openai``, whose calls are harmony messages)."""
    output_format = TOOL_CALL_FORMATS.get(parser_name)
    if output_format is None:
        known = ", ".join(sorted(TOOL_CALL_FORMATS))
        raise ValueError(f"{needed_for} needs a tool_call_parser whose calls a grammar can write ({known}); "
                         f"{parser_name!r} has none")
    return output_format


def _held_calls(tools: Sequence[Mapping[str, Any]], parser_name: str, strict_level: str
                ) -> tuple[_Format, dict[str, Mapping[str, Any]]] | None:
    """The parser's format and each function's arguments schema (a strict tool's own, or
    every tool's at the "parameter" level; any object otherwise) where tool_choice "auto"
    holds calls to the format; None where it holds nothing (the "auto" level, no strict
    tool). Raises ValueError naming a bad level, parser or tool."""
    if strict_level not in TOOL_STRICT_LEVELS:
        raise ValueError(f"tool_strict_level must be one of {', '.join(TOOL_STRICT_LEVELS)}, got {strict_level!r}")
    functions = tool_functions(tools)
    strict = {name for name, tool in zip(functions, tools, strict=True) if _is_strict(tool)}
    if strict_level == "auto" and not strict:
        return None
    output_format = _output_format(parser_name, "strict tools (or a tool_strict_level other than auto)")
    return output_format, {name: schema if strict_level == "parameter" or name in strict else ANY_ARGUMENTS
                           for name, schema in functions.items()}


def _as_format(output: StructuredOutput) -> dict[str, Any]:
    """A constraint as a structural tag's format (xgrammar's spelling)."""
    kind = output.kind
    if kind in ("json_schema", "json_object"):
        return {"type": "json_schema", "json_schema": json.loads(output.text)}
    if kind == "regex":
        return {"type": "regex", "pattern": output.text}
    if kind == "grammar":
        return {"type": "grammar", "grammar": output.text}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(output.text)]}
    return structural_tag_format(json.loads(output.text))


def _json_call(name: str, schema: Mapping[str, Any], output_format: _Format) -> dict[str, Any]:
    """One call as a tag around nothing but its JSON object, ``{"name": ..., <key>: ...}``."""
    key = output_format.arguments_key
    call = {"type": "object", "properties": {"name": {"const": name}, key: dict(schema)},
            "required": ["name", key], "additionalProperties": False}
    return {"type": "tag", "begin": "", "content": {"type": "json_schema", "json_schema": call}, "end": ""}


def _call_tag(name: str, schema: Mapping[str, Any], output_format: _Format) -> dict[str, Any]:
    """One call as a structural tag: the envelope up to the arguments, then them."""
    head = json.dumps({"name": name, output_format.arguments_key: 0}, ensure_ascii=False)[:-2]
    return {"type": "tag", "begin": output_format.call_open + head,
            "content": {"type": "json_schema", "json_schema": dict(schema)}, "end": "}" + output_format.call_close}


def _auto_format(calls: list[dict[str, Any]], output_format: _Format, parallel: bool) -> dict[str, Any]:
    """Free text, and calls where the parser would read them."""
    if output_format.call_open:  # hermes: a call anywhere, each opened by its marker
        return {"type": "triggered_tags", "triggers": [output_format.call_open.rstrip()], "tags": calls,
                "stop_after_first": not parallel}
    listed = {"type": "tags_with_separator", "tags": calls, "separator": output_format.separator,
              "at_least_one": True, "stop_after_first": not parallel}
    if output_format.prefix:  # mistral: a list of calls anywhere, opened by its marker
        marker = output_format.prefix.rstrip("[")
        return {"type": "triggered_tags", "triggers": [marker], "stop_after_first": not parallel,
                "tags": [{"type": "tag", "begin": output_format.prefix, "content": listed,
                          "end": output_format.suffix}]}
    # llama3_json: calls only at the start of the output; text otherwise, which must not
    # start as a call would (whitespace, "{" or "<" first: the parser could read a call
    # there, one the grammar would not have checked).
    return {"type": "or", "elements": [listed, {"type": "regex", "pattern": r"([^\s{<][\s\S]*)?"}]}


def _is_strict(tool: Mapping[str, Any]) -> bool:
    return tool["function"].get("strict") is True  # tool_functions checked it is a bool


def _grammar(functions: Mapping[str, Mapping[str, Any]], output_format: _Format, parallel: bool) -> str:
    rules = []
    for number, (name, schema) in enumerate(functions.items()):
        head = json.dumps({"name": name, output_format.arguments_key: 0}, ensure_ascii=False)
        head = head[:-2]  # '{"name": "f", "arguments": ' : the value follows
        # Compact JSON: free whitespace lets small models emit newlines forever.
        compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"fn_{number}: {_literal(output_format.call_open + head)} args_{number} "
                     f"{_literal('}' + output_format.call_close)}")
        rules.append(f"args_{number}: %json {json.dumps(compact, ensure_ascii=False)}")
    call = " | ".join(f"fn_{number}" for number in range(len(functions)))
    repeat = f" ({_literal(output_format.separator)} call)*" if parallel else ""
    start = " ".join(part for part in (_literal(output_format.prefix), f"call{repeat}",
                                       _literal(output_format.suffix)) if part)
    return "\n".join([f"start: {start}", f"call: {call}", *rules])


def _literal(text: str) -> str:
    """``text`` as a Lark string literal ("" for none: Lark has no empty literal).
    JSON string literals are valid Lark string literals (same escapes)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def tool_functions(tools: object) -> dict[str, Mapping[str, Any]]:
    """Function name -> parameters schema of OpenAI ``tools``, validated, in the order
    given; ``InvalidTools`` (a ValueError whose ``param`` names the tool) otherwise."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools:
        raise InvalidTools("tools must be a non-empty list of function tools", "tools")
    functions: dict[str, Mapping[str, Any]] = {}
    for number, tool in enumerate(tools):
        where = f"tools[{number}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidTools(f"{where}.type must be 'function'", where)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidTools(f"{where}.function must be an object", where)
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise InvalidTools(f"{where}.function.name must match {_FUNCTION_NAME.pattern}, got {name!r}", where)
        if name in functions:
            raise InvalidTools(f"{where}.function.name {name!r} is given twice", where)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise InvalidTools(f"{where}.function.parameters must be a JSON schema object", where)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidTools(f"{where}.function.strict must be a bool, got {strict!r}", where)
        functions[name] = parameters
    return functions


def _named_choice(tool_choice: object) -> str:
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name must be a string")
    return name
