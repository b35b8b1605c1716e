"""``StructuredOutput``: what a request's output must look like, validated on construction.

Exactly one kind of constraint is set. The object is frozen and pure Python (no
llguidance import), so ``SamplingParams`` can hold it and copies of a request's
params (``n > 1``) share it. ``cache_key`` is what compiled grammars are cached by.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The kinds, in the order error messages list them.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")

# "Any JSON object": what OpenAI's response_format={"type": "json_object"} promises.
ANY_JSON_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on one request's output; set exactly one of the first six fields.

    json_schema: a JSON Schema (a dict, or its JSON text); the output is a JSON value
        valid under it. Key order in ``properties`` is the order keys are generated in.
    json_object: True for any JSON object.
    regex: the whole output matches this regular expression (Rust ``regex`` syntax).
    grammar: a Lark grammar (llguidance dialect) or a GBNF grammar (llama.cpp, ``::=``).
    choice: the output is exactly one of these strings.
    structural_tag: vLLM's structural tag (a dict, or its JSON text): free text with
        structured regions opened by trigger strings, in its legacy spelling
        (``structures`` and ``triggers``) or xgrammar's (``format``); see
        ``kvloom.structured.structural_tag``.
    jump_forward: append the tokens the grammar forces without a model step each
        (and end the request as soon as the grammar is complete). Off only to measure it.
    after_token_id: the constraint starts after the output's first token of this id (a
        reasoning model's ``</think>``: the reasoning is free, the answer constrained), or
        after it first ends with this sequence of ids (GPT-OSS's ``<|channel|>final
        <|message|>``); None: from the first token. Not part of the grammar (``cache_key``).
    """

    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    structural_tag: Mapping[str, Any] | str | None = None
    jump_forward: bool = True
    after_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in CONSTRAINT_KINDS if self._is_set(kind)]
        if len(given) != 1:
            listed = ", ".join(CONSTRAINT_KINDS)
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured output needs exactly one of {listed}; {found}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be a bool, got {self.jump_forward!r}")
        if self.after_token_id is not None:
            ids = self.after_token_id if isinstance(self.after_token_id, (tuple, list)) else (self.after_token_id,)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError("after_token_id must be a token id (an int >= 0), a non-empty sequence of them, "
                                 f"or None, got {self.after_token_id!r}")
            if isinstance(self.after_token_id, list):
                object.__setattr__(self, "after_token_id", tuple(ids))
        kind = given[0]
        if kind == "json_schema":
            # Normalised to compact text once: it is both the cache key and the compiler input.
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
        elif kind == "choice":
            object.__setattr__(self, "choice", _choices(self.choice))
        elif kind == "structural_tag":
            object.__setattr__(self, "structural_tag", _structural_tag_text(self.structural_tag))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not False and value is not None

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``CONSTRAINT_KINDS``."""
        return next(kind for kind in CONSTRAINT_KINDS if self._is_set(kind))

    @property
    def text(self) -> str:
        """The constraint as text: schema JSON, regex, grammar, or the choices as JSON."""
        kind = self.kind
        if kind == "json_object":
            return ANY_JSON_OBJECT_SCHEMA
        if kind == "choice":
            return json.dumps(list(self.choice or ()), ensure_ascii=False)
        value = getattr(self, kind)
        assert isinstance(value, str)  # normalised in __post_init__
        return value

    @property
    def cache_key(self) -> tuple[str, str]:
        """(kind, text): equal keys compile to the same grammar."""
        return self.kind, self.text


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's spelling of a constraint, so that vLLM code ports unchanged:
    ``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``. Set one of
    ``json`` (a JSON Schema), ``regex``, ``choice``, ``grammar``, ``json_object``,
    ``structural_tag`` (its JSON text, as vLLM takes it, or a dict); it becomes the
    request's :class:`StructuredOutput`."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Mapping[str, Any] | str | None = None

    def to_structured_output(self) -> StructuredOutput:
        return StructuredOutput(json_schema=self.json, json_object=bool(self.json_object), regex=self.regex,
                                grammar=self.grammar, choice=self.choice, structural_tag=self.structural_tag)


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
    if not isinstance(schema, (Mapping, bool)):
        raise ValueError(
            f"json_schema must be a JSON object (a dict or its JSON text), got {type(schema).__name__}"
        )
    try:
        # No sort_keys: property order is generation order.
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"json_schema must be JSON-serialisable: {error}") from None


# Caps on a choice constraint (named in the error): its options become one lexer
# automaton, whose size grows with their total length.
MAX_CHOICES = 16384
MAX_CHOICE_CHARS = 4096


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise ValueError(f"choice must be a list of strings, got {choice!r}"[:200])
    values = tuple(choice)
    if not values:
        raise ValueError("choice must contain at least one string")
    if len(values) > MAX_CHOICES:
        raise ValueError(f"choice may hold at most {MAX_CHOICES} options, got {len(values)}")
    for value in values:
        if not isinstance(value, str) or value == "":
            raise ValueError(f"choice must contain non-empty strings, got {value!r}"[:200])
        if len(value) > MAX_CHOICE_CHARS:
            raise ValueError(f"choice options may be at most {MAX_CHOICE_CHARS} characters, got one of {len(value)}")
    return values


def _structural_tag_text(value: object) -> str:
    """The spec as compact JSON text (the constraint's cache key), checked for its
    outer shape; the formats inside are checked when the grammar is written."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"structural_tag is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"structural_tag must be a JSON object, got {type(value).__name__}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag.type must be 'structural_tag', got {value.get('type')!r}")
    has_format = "format" in value
    has_legacy = "structures" in value or "triggers" in value
    if has_format == has_legacy:
        raise ValueError("structural_tag needs either 'format' (xgrammar's spelling) or 'structures' "
                         "with 'triggers' (the legacy one)")
    extra = set(value) - ({"type", "format"} if has_format else {"type", "structures", "triggers"})
    if extra:
        raise ValueError(f"structural_tag has unknown field(s) {', '.join(sorted(extra))}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structural_tag must be JSON-serialisable: {error}") from None


def structural_tag_format(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A structural tag's format tree (xgrammar's spelling): its ``format``, or the legacy
    ``structures`` and ``triggers`` as the triggered_tags format they mean (ValueError
    naming a malformed structure)."""
    if "format" in spec:
        return spec["format"]
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    tags = []
    for number, structure in enumerate(structures):
        where = f"structural_tag.structures[{number}]"
        if not isinstance(structure, Mapping) or set(structure) - {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object with 'begin', 'schema' and 'end'")
        begin = structure.get("begin")
        if isinstance(triggers, list) and not any(isinstance(t, str) and t and isinstance(begin, str)
                                                  and begin.startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin must start with one of the triggers {triggers}, got {begin!r}")
        schema = structure.get("schema")
        tags.append({"type": "tag", "begin": structure.get("begin"), "end": structure.get("end"),
                     "content": {"type": "json_schema", "json_schema": {} if schema is None else schema}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}
