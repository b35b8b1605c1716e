"""vLLM's ``structural_tag`` constraint: free text with structured regions, as Lark.

A structural tag describes output in which structured parts (a tool call's JSON
arguments between ``<function=name>`` and ``</function>``, say) appear at places the
model chooses, marked by trigger strings. Two spellings are accepted, both vLLM's:

* the legacy one, ``{"type": "structural_tag", "structures": [{"begin", "schema",
  "end"}], "triggers": [...]}``: free text in which each trigger starts one of the
  structures whose ``begin`` starts with it;
* xgrammar's, ``{"type": "structural_tag", "format": F}``, where F is a tree of
  formats: ``const_string``, ``json_schema``, ``regex``, ``grammar``, ``any_text``,
  ``token``, ``sequence``, ``or``, ``tag``, ``triggered_tags``, ``tags_with_separator``,
  ``optional``, ``plus``, ``star``, ``repeat``. The token-level and dispatch formats
  and the XML styles of ``json_schema`` are refused by name.

The semantics are xgrammar's (the tests hold the grammar to xgrammar's matcher on
hand-written outputs), written as an llguidance Lark grammar. Two rules carry it:

* Free text never contains a trigger, so a trigger always opens a tag (and an
  ``excludes`` string never appears). Written as a lexeme ``any & ~(any "t" any)``.
* ``any_text`` runs to the first of the strings that follow it (a tag's end, the
  next constant): a lazy rule that takes those strings too, so the caller does not
  write them again (``_Expr.took_follow``). Without a string after it, ``any_text``
  must end the output.

JSON inside a tag is compact unless the schema asks for free whitespace
(``{"x-guidance": {"whitespace_flexible": true}}``), as kvloom's ``json_schema``
constraint (xgrammar allows whitespace by default).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from kvloom.structured.constraint import structural_tag_format

# The end of the output: what may follow the top-level format.
END = "END"
# What follows a format: END, the strings one of which comes next, or None (a format
# whose successor is not a string: any_text cannot stand there).
Follow = str | tuple[str, ...] | None

SUPPORTED_FORMATS = ("const_string", "json_schema", "regex", "grammar", "any_text", "token", "sequence",
                     "or", "tag", "triggered_tags", "tags_with_separator", "optional", "plus", "star",
                     "repeat")
_ANY = r"/(.|\n)*/"


def structural_tag_grammar(text: str, token_id: Callable[[str], int | None], vocab_size: int) -> str:
    """llguidance's grammar (Lark text, or its JSON with side grammars) for the spec
    ``text`` (``StructuredOutput``'s normalised JSON). ``token_id`` resolves a ``token``
    format's string. Raises ValueError naming the field at fault."""
    spec = json.loads(text)
    writer = _LarkWriter(token_id, vocab_size)
    root = writer.format(structural_tag_format(spec), END,
                         "structural_tag.format" if "format" in spec else "structural_tag")
    lark = "\n".join([f"start: {root.expr}", *writer.rules])
    if not writer.side_grammars:
        return lark
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *writer.side_grammars]})


@dataclass(frozen=True, slots=True)
class _Expr:
    """A format as a Lark expression; ``took_follow``: it also takes the strings that
    follow it (an any_text's lazy end), which the caller must then not write."""

    expr: str
    took_follow: bool = False


class _LarkWriter:
    """Writes formats as Lark rules (``self.rules``), one method per format type."""

    def __init__(self, token_id: Callable[[str], int | None], vocab_size: int) -> None:
        self.token_id = token_id
        self.vocab_size = vocab_size
        self.rules: list[str] = []
        self.side_grammars: list[dict[str, str]] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def format(self, node: object, follow: Follow, where: str) -> _Expr:
        if not isinstance(node, Mapping):
            raise ValueError(f"{where} must be a format object, got {type(node).__name__}")
        kind = node.get("type")
        method = getattr(self, f"_{kind}", None) if kind in SUPPORTED_FORMATS else None
        if method is None:
            raise ValueError(f"{where}.type {kind!r} is not supported: the format types are "
                             f"{', '.join(SUPPORTED_FORMATS)}")
        return method(node, follow, where)

    # -- leaves --------------------------------------------------------------------

    def _const_string(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "value")
        return _Expr(_literal(_string(node, "value", where)))

    def _json_schema(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "json_schema", "style")
        if node.get("style", "json") != "json":
            raise ValueError(f"{where}.style {node['style']!r} is not supported: only 'json'")
        schema = node.get("json_schema")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where}.json_schema must be a JSON schema object")
        compact = {"x-guidance": {"whitespace_flexible": False}, **schema}
        return _Expr(self.rule(f"%json {json.dumps(compact, ensure_ascii=False)}"))

    def _regex(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "pattern")
        pattern = _string(node, "pattern", where, empty=False)
        return _Expr(self.rule(f"/{llguidance.regex_to_lark(pattern)}/"))

    def _grammar(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "grammar")
        source = _string(node, "grammar", where, empty=False)
        try:
            lark = llguidance.grammar_from("grammar", source)  # Lark as is; GBNF converted
        except ValueError as error:
            raise ValueError(f"{where}.grammar: {error}") from None
        name = f"g{len(self.side_grammars)}"
        self.side_grammars.append({"name": name, "lark_grammar": lark})
        return _Expr(f"@{name}")

    def _token(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "token")
        return _Expr(self._token_ref(node.get("token"), f"{where}.token"))

    def _token_ref(self, token: object, where: str) -> str:
        token_id = self.token_id(token) if isinstance(token, str) else token
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{where} must be a token id or a token of the vocabulary, got {token!r}")
        return f"<[{token_id}]>"

    def _any_text(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "excludes")
        text = self._free_text(_strings(node.get("excludes", []), f"{where}.excludes"))
        if follow == END:
            return _Expr(text)
        if follow is None:
            raise ValueError(f"{where}: any_text must end the output or be followed by a string "
                             "(a tag's end, a const_string)")
        return _Expr(self.rule(f"{text} {_alternatives(follow)}", lazy=True), took_follow=True)

    def _free_text(self, excluded: Sequence[str]) -> str:
        """A terminal: any text in which none of ``excluded`` occurs."""
        name = f"TEXT{len(self.rules)}"
        body = _ANY if not excluded else f"{_ANY} & ~({_ANY} {_alternatives(tuple(excluded))} {_ANY})"
        self.rules.append(f"{name}: {body}")
        return name

    # -- combinations --------------------------------------------------------------

    def _sequence(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "elements")
        elements = _list(node, "elements", where)
        parts: list[str] = []
        number, took = 0, False
        while number < len(elements):
            last = number == len(elements) - 1
            after: Follow = follow if last else _leading_string(elements[number + 1])
            part = self.format(elements[number], after, f"{where}.elements[{number}]")
            parts.append(part.expr)
            # A lazy any_text took the next constant (or the sequence's follow) already.
            number += 2 if part.took_follow and not last else 1
            took = part.took_follow and last
        return _Expr(self.rule(" ".join(p for p in parts if p) or '""'), took_follow=took)

    def _or(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "elements")
        options = [self.format(element, follow, f"{where}.elements[{number}]")
                   for number, element in enumerate(_list(node, "elements", where))]
        if not any(option.took_follow for option in options):
            return _Expr(self.rule(" | ".join(option.expr for option in options)))
        # Some took the following strings: the others write them, so that all do.
        assert isinstance(follow, tuple)
        bodies = [option.expr if option.took_follow else f"{option.expr} {_alternatives(follow)}"
                  for option in options]
        return _Expr(self.rule(" | ".join(bodies)), took_follow=True)

    def _tag_rule(self, node: Mapping[str, Any], where: str, skip: str = "") -> str:
        """``begin content end`` as a rule; ``skip``: the begin's first characters,
        written by the caller (a trigger)."""
        _fields(node, where, "begin", "content", "end")
        begin = node.get("begin")
        begin_expr = (_literal(begin[len(skip):]) if isinstance(begin, str)
                      else self._token_ref(_token_of(begin, f"{where}.begin"), f"{where}.begin.token"))
        end = node.get("end")
        if isinstance(end, str):
            ends: tuple[str, ...] = (end,)
        elif isinstance(end, list):
            ends = _strings(end, f"{where}.end")
            if not ends:
                raise ValueError(f"{where}.end must name at least one string")
        else:
            ends = ()
        end_expr = (_alternatives(ends) if ends
                    else self._token_ref(_token_of(end, f"{where}.end"), f"{where}.end.token"))
        content_follow: Follow = tuple(e for e in ends if e) if ends and all(ends) else None
        content = self.format(node.get("content"), content_follow, f"{where}.content")
        body = [begin_expr, content.expr] + ([] if content.took_follow else [end_expr])
        return self.rule(" ".join(p for p in body if p) or '""')

    def _tag(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        return _Expr(self._tag_rule(node, where))

    def _tags(self, node: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
        tags = _list(node, "tags", where)
        for number, tag in enumerate(tags):
            if not isinstance(tag, Mapping) or tag.get("type", "tag") != "tag":
                raise ValueError(f"{where}.tags[{number}] must be a tag format")
        return tags

    def _triggered_tags(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "triggers", "tags", "at_least_one", "stop_after_first", "excludes")
        triggers = _strings(node.get("triggers"), f"{where}.triggers")
        if not triggers or not all(triggers):
            raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
        if follow is None:
            raise ValueError(f"{where}: triggered_tags must end the output or be followed by a string")
        # Free text holds no trigger (each one opens a tag), no excluded string and, inside
        # a tag, not the strings that end it.
        ends = () if follow == END else follow
        excluded = (*triggers, *_strings(node.get("excludes", []), f"{where}.excludes"), *ends)
        text = self._free_text(excluded)
        opened, whole = [], []
        for number, tag in enumerate(self._tags(node, where)):
            at = f"{where}.tags[{number}]"
            begin = tag.get("begin")
            matching = [t for t in triggers if isinstance(begin, str) and begin.startswith(t)]
            if len(matching) != 1:
                raise ValueError(f"{at}.begin must start with exactly one of the triggers {list(triggers)}, "
                                 f"got {begin!r}")
            trigger_text = self.rule(f"{text} {_literal(matching[0])}", lazy=True)
            opened.append(f"{trigger_text} {self._tag_rule(tag, at, skip=matching[0])}")
            whole.append(self._tag_rule(tag, at))
        tail = text if follow == END else self.rule(f"{text} {_alternatives(ends)}", lazy=True)
        any_opened = self.rule(" | ".join(opened))
        first = self.rule(" | ".join(whole))
        at_least_one, stop_after_first = _flag(node, "at_least_one", where), _flag(node, "stop_after_first", where)
        after_tag = "" if follow == END else _alternatives(ends)
        if at_least_one and stop_after_first:
            body = f"{first} {after_tag}"
        elif at_least_one:
            body = f"{first} {any_opened}* {tail}"
        elif stop_after_first:
            body = f"{tail} | {any_opened} {after_tag}"
        else:
            body = f"{any_opened}* {tail}"
        return _Expr(self.rule(body), took_follow=follow != END)

    def _tags_with_separator(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "tags", "separator", "at_least_one", "stop_after_first")
        separator = _literal(_string(node, "separator", where))
        one = self.rule(" | ".join(self._tag_rule(tag, f"{where}.tags[{number}]")
                                   for number, tag in enumerate(self._tags(node, where))))
        at_least_one, stop_after_first = _flag(node, "at_least_one", where), _flag(node, "stop_after_first", where)
        some = one if stop_after_first else f"{one} ({separator} {one})*"
        return _Expr(self.rule(some if at_least_one else f"({some})?"))

    def _repeated(self, node: Mapping[str, Any], where: str, suffix: str) -> _Expr:
        content = self.format(node.get("content"), None, f"{where}.content")
        return _Expr(self.rule(f"({content.expr}){suffix}"))

    def _optional(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "content")
        return self._repeated(node, where, "?")

    def _plus(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "content")
        return self._repeated(node, where, "+")

    def _star(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "content")
        return self._repeated(node, where, "*")

    def _repeat(self, node: Mapping[str, Any], follow: Follow, where: str) -> _Expr:
        _fields(node, where, "content", "min", "max")
        low, high = node.get("min"), node.get("max")
        if not _count(low) or not (high == -1 or (_count(high) and high >= low)):
            raise ValueError(f"{where}: repeat needs 0 <= min <= max (max -1: unbounded), got {low!r}, {high!r}")
        return self._repeated(node, where, f"{{{low},}}" if high == -1 else f"{{{low},{high}}}")


def _leading_string(node: object) -> Follow:
    """The constant a format starts with, where it is one (what an any_text before it runs to)."""
    if isinstance(node, Mapping) and node.get("type") == "const_string":
        value = node.get("value")
        if isinstance(value, str) and value:
            return (value,)
    return None


def _literal(text: str) -> str:
    """``text`` as a Lark string literal ("" where empty: Lark has no empty literal).
    JSON's escapes are Lark's; DEL, which the lexer refuses raw, is escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f") if text else ""


def _alternatives(strings: tuple[str, ...]) -> str:
    return _literal(strings[0]) if len(strings) == 1 else "(" + " | ".join(map(_literal, strings)) + ")"


def _fields(node: Mapping[str, Any], where: str, *allowed: str) -> None:
    extra = set(node) - {"type", *allowed}
    if extra:
        raise ValueError(f"{where} has unknown field(s) {', '.join(sorted(extra))}")


def _string(node: Mapping[str, Any], key: str, where: str, empty: bool = True) -> str:
    value = node.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise ValueError(f"{where}.{key} must be a{'' if empty else ' non-empty'} string, got {value!r}"[:200])
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{where} must be a list of strings")
    return tuple(value)


def _list(node: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty list")
    return value


def _flag(node: Mapping[str, Any], key: str, where: str) -> bool:
    value = node.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be a bool, got {value!r}")
    return value


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_of(value: object, where: str) -> object:
    if isinstance(value, Mapping) and value.get("type") == "token" and set(value) <= {"type", "token"}:
        return value.get("token")
    raise ValueError(f"{where} must be a string or a token format ({{'type': 'token', 'token': ...}})")
