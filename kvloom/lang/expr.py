"""What a program appends to its state: text, chat roles, ``gen`` and ``select``.

Expressions are values: ``s += user("hi") + assistant(gen("a"))`` builds a ``Concat``
and the state runs it in order. Each ``gen`` / ``select`` remembers the program line
that made it, for errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvloom.lang.errors import LangError, Where, caller
from kvloom.sampling_params import SamplingParams
from kvloom.structured import StructuredOutput


class Expr:
    def __add__(self, other: Expr | str) -> Concat:
        return Concat((*_parts(self), *_parts(as_expr(other))))

    def __radd__(self, other: str) -> Concat:
        return Concat((*_parts(as_expr(other)), *_parts(self)))


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class Role(Expr):
    """A chat message: the template's opening for ``role``, the body, its closing."""

    role: str
    body: Expr


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    max_tokens: int
    stop: tuple[str, ...]
    temperature: float
    regex: str | None
    json_schema: dict[str, Any] | str | None
    where: Where | None = field(compare=False)

    def sampling_params(self) -> SamplingParams:
        structured = None
        if self.regex is not None:
            structured = StructuredOutput(regex=self.regex)
        elif self.json_schema is not None:
            structured = StructuredOutput(json_schema=self.json_schema)
        return SamplingParams(max_tokens=self.max_tokens, stop=list(self.stop), temperature=self.temperature,
                              structured=structured)


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    where: Where | None = field(compare=False)


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise LangError(f"a program appends text or kvloom.lang expressions, got {type(value).__name__}", caller())


def _parts(expr: Expr) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, Concat) else (expr,)


def gen(name: str | None = None, max_tokens: int = 128, stop: str | list[str] | None = None,
        temperature: float = 0.0, regex: str | None = None,
        json_schema: dict[str, Any] | str | None = None) -> Gen:
    """Generate a continuation of the state's text (into variable ``name``)."""
    where = caller()
    if regex is not None and json_schema is not None:
        raise LangError("gen takes regex or json_schema, not both", where)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise LangError(f"gen max_tokens must be a positive integer, got {max_tokens!r}", where)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    expr = Gen(name, max_tokens, stops, temperature, regex, json_schema, where)
    try:  # checked here, with this line to name, not at the program's next sync point
        expr.sampling_params()
    except ValueError as error:
        raise LangError(f"gen {name!r}: {error}", where) from None
    return expr


def select(name: str | None, choices: list[str]) -> Select:
    """Append the choice the model finds likeliest after the state's text (the highest
    sum of its tokens' log-probabilities); ``name`` holds it."""
    where = caller()
    if not choices:
        raise LangError(f"select {name!r} got an empty choice list", where)
    if not all(isinstance(c, str) and c for c in choices):
        raise LangError(f"select {name!r} choices must be non-empty strings, got {choices!r}", where)
    return Select(name, tuple(choices), where)


def system(body: Expr | str) -> Role:
    return Role("system", as_expr(body))


def user(body: Expr | str) -> Role:
    return Role("user", as_expr(body))


def assistant(body: Expr | str) -> Role:
    return Role("assistant", as_expr(body))
