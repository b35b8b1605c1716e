"""Regex, choice and grammar constraints on the default model, sampled: outputs always
match (checked with ``re`` and with an independent recursive-descent parser)."""

from __future__ import annotations

import re

import pytest
from structured_helpers import TICKET, chat_prompt, default_engine, default_llm, json_prompt, run

from kvloom import SamplingParams
from kvloom.structured import StructuredOutput

DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"

# The same arithmetic language in both grammar dialects: at least one operator.
ARITHMETIC_GBNF = r"""
root   ::= term ("+" | "-" | "*") expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""
ARITHMETIC_LARK = r"""
start: term ("+" | "-" | "*") expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}|0/
"""


def parse_arithmetic(text: str) -> None:
    """Raises ValueError unless ``text`` is in the arithmetic language above.

    ``term op expr`` is the language of ``expr`` restricted to strings with a "+", "-" or
    "*" outside parentheses, so: recursive descent for ``expr``, then that check.
    """
    position = 0

    def peek() -> str:
        return text[position] if position < len(text) else ""

    def eat(char: str) -> None:
        nonlocal position
        if peek() != char:
            raise ValueError(f"expected {char!r} at {position} in {text!r}")
        position += 1

    def number() -> None:
        nonlocal position
        match = re.match(r"[1-9][0-9]{0,2}|0", text[position:])
        if match is None:
            raise ValueError(f"expected a number at {position} in {text!r}")
        position += match.end()

    def factor() -> None:
        if peek() == "(":
            eat("(")
            expr()
            eat(")")
        else:
            number()

    def term() -> None:
        factor()
        while peek() and peek() in "*/":
            eat(peek())
            factor()

    def expr() -> None:
        term()
        while peek() and peek() in "+-":
            eat(peek())
            term()

    expr()
    if position != len(text):
        raise ValueError(f"trailing text at {position} in {text!r}")
    depth, top_level_operators = 0, 0
    for char in text:
        depth += (char == "(") - (char == ")")
        top_level_operators += depth == 0 and char in "+-*"
    if not top_level_operators:
        raise ValueError(f"no +, - or * outside parentheses in {text!r}")


def test_recursive_descent_oracle() -> None:
    for good in ("1+2", "(2+3)*4", "12*2*3+4", "7/(1-2)*3", "4/2*3"):
        parse_arithmetic(good)
    for bad in ("12", "(1+2)", "4/2", "1+", "(1+2", "1++2", "01+2", "1+2)", "1 + 2"):
        with pytest.raises(ValueError):
            parse_arithmetic(bad)


def test_regex_choice_and_grammar_outputs_always_match() -> None:
    engine = default_engine()
    requests = {}
    sentiment = "Is the review 'the plot was dull' positive, negative or neutral?"
    date = "When did the Berlin wall fall? Answer as YYYY-MM-DD."
    for seed in range(4):
        def sampled(constraint: StructuredOutput, max_tokens: int = 24, seed: int = seed) -> SamplingParams:
            return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, structured=constraint)
        requests[f"date-{seed}"] = (chat_prompt(engine, date), sampled(StructuredOutput(regex=DATE)))
        requests[f"phone-{seed}"] = (chat_prompt(engine, "Make up a US phone number."),
                                     sampled(StructuredOutput(regex=PHONE)))
        requests[f"choice-{seed}"] = (chat_prompt(engine, sentiment),
                                      sampled(StructuredOutput(choice=["positive", "negative", "neutral"])))
        for dialect, grammar in (("gbnf", ARITHMETIC_GBNF), ("lark", ARITHMETIC_LARK)):
            prompt = f"Write an arithmetic expression such as (2+3)*4 that equals {12 * (seed + 1)}."
            requests[f"{dialect}-{seed}"] = (chat_prompt(engine, prompt),
                                             sampled(StructuredOutput(grammar=grammar), max_tokens=40))
    finals = run(engine, requests)
    for request_id, output in finals.items():
        kind = request_id.split("-")[0]
        completion = output.outputs[0]
        text = completion.text
        if kind in ("gbnf", "lark") and completion.finish_reason == "length":
            # The grammar is unbounded ("2*3*4*..."): a sampled run may hit max_tokens.
            assert len(completion.token_ids) == 40 and re.fullmatch(r"[0-9+\-*/()]+", text), text
            continue
        assert completion.finish_reason == "stop", (request_id, text)
        if kind == "date":
            assert re.fullmatch(DATE, text), text
        elif kind == "phone":
            assert re.fullmatch(PHONE, text), text
        elif kind == "choice":
            assert text in ("positive", "negative", "neutral")
        else:
            parse_arithmetic(text)
    # Same seeds, same language: the two dialects constrain identically.
    assert [finals[f"gbnf-{s}"].outputs[0].text for s in range(4)] == \
        [finals[f"lark-{s}"].outputs[0].text for s in range(4)]


def test_choice_with_n_samples() -> None:
    llm = default_llm()
    choices = ["red", "green", "blue", "dark purple"]
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3,
                            structured=StructuredOutput(choice=choices))
    prompt = chat_prompt(llm.engine, "Name a colour.")
    for completion in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
        assert completion.text in choices and completion.finish_reason == "stop"
    llm.engine.check_integrity()


def test_streaming_with_forced_tokens_and_logprobs() -> None:
    """Steps that append several tokens stream them as one delta; deltas concatenate
    to the final output, and forced tokens get logprobs so the lists stay aligned."""
    engine = default_engine()
    deltas: list[str] = []
    delta_tokens: list[list[int]] = []

    def collect(output) -> None:
        deltas.append(output.outputs[0].delta_text)
        delta_tokens.append(output.outputs[0].delta_token_ids)

    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=2,
                            structured=StructuredOutput(json_schema=TICKET))
    final = run(engine, {"stream": (json_prompt(engine, "a login bug"), params)},
                on_output=collect)["stream"].outputs[0]
    assert "".join(deltas) == final.text
    assert [t for delta in delta_tokens for t in delta] == final.token_ids
    assert max(len(delta) for delta in delta_tokens) > 1  # jump-forward happened
    assert final.logprobs is not None and len(final.logprobs) == len(final.token_ids)
    for token_id, logprobs in zip(final.token_ids, final.logprobs, strict=True):
        assert token_id in logprobs
