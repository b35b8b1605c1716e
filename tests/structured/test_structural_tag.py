"""vLLM's ``structural_tag`` constraint, held to xgrammar's matcher (vLLM's default
backend, and the library that defines the format): every hand-written output below is
accepted as a whole output by kvloom's grammar exactly where xgrammar accepts it. Then
bad specs named, and the default model generating under it (offline and over HTTP),
its outputs accepted by xgrammar and their JSON valid under the schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structured_helpers import chat_prompt, default_engine, default_llm
from transformers import PreTrainedTokenizerFast

from kvloom import SamplingParams, StructuredOutputsParams
from kvloom.structured import StructuredOutput, structured_output_from_openai
from kvloom.structured.compiler import GrammarCompiler
from kvloom.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
EMPTY = {"type": "object", "maxProperties": 0}


def fmt(format_: dict) -> dict:
    return {"type": "structural_tag", "format": format_}


def tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def schema(value: dict) -> dict:
    return {"type": "json_schema", "json_schema": value}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


ANY = {"type": "any_text"}
CALL_CITY = tag("<f=city>", schema(CITY), "</f>")
CALL_PING = tag("<f=ping>", schema(EMPTY), "</f>")
TRIGGERED = {"type": "triggered_tags", "triggers": ["<f="], "tags": [CALL_CITY, CALL_PING]}
LEGACY = {"type": "structural_tag", "triggers": ["<f="],
          "structures": [{"begin": "<f=city>", "schema": CITY, "end": "</f>"},
                         {"begin": "<f=ping>", "schema": EMPTY, "end": "</f>"}]}
CITY_CALL, PING_CALL = '<f=city>{"city":"Oslo"}</f>', "<f=ping>{}</f>"
TRIGGER_TEXTS = ["", "hello", f"a {CITY_CALL} b", PING_CALL, f"{PING_CALL}{CITY_CALL}end",
                 f"x {CITY_CALL}\n{PING_CALL}", "x <f=nope>{}</f>", 'x <f=city>{"city":"Rome"}</f>',
                 'x <f=city>{"city":"Oslo"}', "a <f=ping>{}</f", "a <f=ping>{}</f><f=", "a <f"]

# (name, spec, outputs): each output is accepted or not as xgrammar decides.
CASES = [
    ("legacy", LEGACY, TRIGGER_TEXTS),
    ("triggered_tags", fmt(TRIGGERED), TRIGGER_TEXTS),
    ("triggered_tags at_least_one", fmt({**TRIGGERED, "at_least_one": True}), TRIGGER_TEXTS),
    ("triggered_tags stop_after_first", fmt({**TRIGGERED, "stop_after_first": True}), TRIGGER_TEXTS),
    ("triggered_tags at_least_one stop_after_first",
     fmt({**TRIGGERED, "at_least_one": True, "stop_after_first": True}), TRIGGER_TEXTS),
    ("triggered_tags excludes", fmt({**TRIGGERED, "excludes": ["bad", "\n"]}),
     ["good", "so bad", f"ok {PING_CALL} fine", f"ok {PING_CALL} bad", "two\nlines", "ba d"]),
    ("tags_with_separator", fmt({"type": "tags_with_separator", "tags": [CALL_CITY, CALL_PING], "separator": ", "}),
     ["", CITY_CALL, f"{CITY_CALL}, {PING_CALL}", f"{CITY_CALL},{PING_CALL}", f"x{CITY_CALL}", f"{CITY_CALL}, "]),
    ("tags_with_separator at_least_one stop_after_first",
     fmt({"type": "tags_with_separator", "tags": [CALL_CITY, CALL_PING], "separator": ";", "at_least_one": True,
          "stop_after_first": True}), ["", CITY_CALL, f"{CITY_CALL};{PING_CALL}"]),
    ("tags_with_separator at_least_one",
     fmt({"type": "tags_with_separator", "tags": [CALL_PING], "separator": ";", "at_least_one": True}),
     ["", PING_CALL, f"{PING_CALL};{PING_CALL}", f"{PING_CALL};"]),
    ("think then calls", fmt({"type": "sequence", "elements": [
        tag("<think>", ANY, "</think>"),
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [CALL_CITY]}]}),
     ["<think>hmm</think>answer", f"<think>a</think>x{CITY_CALL}", "no think", "<think>a</think></think>",
      "<think>a</think>x<f=city>{}</f>", "<think></think>", "<think>a<f=</think>b"]),
    ("a tag of text with two ends", fmt(tag("<a>", {"type": "any_text", "excludes": ["zz"]}, ["</a>", "</b>"])),
     ["<a>hi</a>", "<a>hi</b>", "<a>hi</a>x", "<a>h</a>i</a>", "<a></a>", "<a>zz</a>", "<a>hi"]),
    ("text then a constant", fmt({"type": "sequence", "elements": [ANY, const("END"), {"type": "regex",
                                                                                            "pattern": "[0-9]{2}"}]}),
     ["abcEND12", "END99", "abcEND1", "abc", "abEN12"]),
    ("an or inside a tag", fmt(tag("<t>", {"type": "or", "elements": [const("yes"), ANY]}, "</t>")),
     ["<t>yes</t>", "<t>maybe</t>", "<t></t>", "<t>yes</t>no</t>"]),
    ("text at the end", fmt({"type": "sequence", "elements": [const("A:"), {"type": "any_text",
                                                                            "excludes": ["!"]}]}),
     ["A:", "A: hello", "A: hi!", "B: hi"]),
    ("repeats", fmt({"type": "sequence", "elements": [
        {"type": "optional", "content": const("-")},
        {"type": "plus", "content": {"type": "regex", "pattern": "[0-9]"}},
        {"type": "star", "content": const("!")},
        {"type": "repeat", "min": 1, "max": 2, "content": const("ab")},
        {"type": "repeat", "min": 0, "max": -1, "content": const("c")}]}),
     ["1ab", "-12!!abab", "ab", "1ababab", "1abccc", "-1!ab", "--1ab"]),
    ("a grammar", fmt({"type": "sequence", "elements": [
        const("n="), {"type": "grammar", "grammar": 'root ::= [1-9] [0-9]* ("." [0-9]+)?'}]}),
     ["n=12", "n=1.5", "n=01", "n=", "n=3."]),
]


class XGrammarReference:
    """xgrammar's matcher on the same vocabulary: does it take ``text`` as a whole output?"""

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.eos = eos

    def matcher(self, spec: dict) -> xgrammar.GrammarMatcher:
        if "structures" in spec:  # the legacy spelling, as vLLM hands it to xgrammar
            items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in spec["structures"]]
            return xgrammar.GrammarMatcher(self.compiler.compile_structural_tag(items, spec["triggers"]))
        return xgrammar.GrammarMatcher(self.compiler.compile_structural_tag(json.dumps(spec)))

    def accepts(self, spec: dict, text: str) -> bool:
        matcher = self.matcher(spec)
        return matcher.accept_string(text) and matcher.accept_token(self.eos)

    def accepts_prefix(self, spec: dict, text: str) -> bool:
        return self.matcher(spec).accept_string(text)


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_file(tiny_llama / "tokenizer.json"), vocab_size=512, eos_token_ids=[2])


@pytest.fixture(scope="module")
def reference(tiny_llama) -> XGrammarReference:
    return XGrammarReference(str(tiny_llama / "tokenizer.json"), eos=2)


def accepts(compiler: GrammarCompiler, spec: dict, text: str) -> bool:
    matcher = compiler.compile(StructuredOutput(structural_tag=spec)).new_matcher()
    return matcher.consume_tokens(compiler.ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("name, spec, texts", CASES, ids=[case[0] for case in CASES])
def test_accepts_exactly_what_xgrammar_accepts(compiler, reference, name, spec, texts) -> None:
    expected = {text: reference.accepts(spec, text) for text in texts}
    assert any(expected.values()) and not all(expected.values()), "each case needs both kinds of output"
    assert {text: accepts(compiler, spec, text) for text in texts} == expected


def test_json_inside_is_compact_unless_the_schema_asks(compiler, reference) -> None:
    """kvloom's JSON rule (as for json_schema): no free whitespace by default; xgrammar
    allows it, and so does kvloom where the schema opts in."""
    spaced = '<f=city>{ "city": "Oslo" }</f>'
    assert reference.accepts(LEGACY, spaced)
    assert not accepts(compiler, LEGACY, spaced)
    flexible = {**CITY, "x-guidance": {"whitespace_flexible": True}}
    assert accepts(compiler, fmt(tag("<f=city>", schema(flexible), "</f>")), spaced)


def test_any_text_runs_to_the_first_constant_after_it(compiler, reference) -> None:
    """Inside a tag xgrammar ends any_text at the first end string (``<a>h</a>i</a>`` is
    refused above); in a sequence it lets the text hold the next constant too. kvloom
    ends it at the first occurrence in both places: one rule, and a lexer that need
    not guess which END is the last."""
    spec = CASES[[case[0] for case in CASES].index("text then a constant")][1]
    assert reference.accepts(spec, "aENDbEND12")
    assert not accepts(compiler, spec, "aENDbEND12")
    assert accepts(compiler, spec, "abEND12")


def test_token_formats_take_the_token_itself(compiler) -> None:
    """A begin or end given as a token (by id or by its text) is that token, not its text."""
    spec = fmt(tag({"type": "token", "token": "<|im_start|>"}, const("hi"), {"type": "token", "token": 1}))
    matcher = compiler.compile(StructuredOutput(structural_tag=spec)).new_matcher()
    start = compiler.tokenizer.token_to_id("<|im_start|>")
    assert matcher.consume_tokens([start, *compiler.ll_tokenizer.tokenize_str("hi"), 1]) and matcher.is_accepting()
    as_text = compiler.compile(StructuredOutput(structural_tag=spec)).new_matcher()
    assert not as_text.consume_tokens([compiler.tokenizer.token_to_id("<")])  # the token's text, as text


@pytest.mark.parametrize("spec, message", [
    ("{not json", "structural_tag is not valid JSON"),
    ({"type": "structural_tag"}, "needs either 'format'"),
    ({"type": "structural_tag", "format": ANY, "triggers": ["a"]}, "needs either 'format'"),
    ({"type": "structural_tag", "format": ANY, "extra": 1}, "unknown field"),
    ({"type": "json_schema", "format": ANY}, "structural_tag.type must be 'structural_tag'"),
])
def test_bad_outer_shapes_are_named_at_construction(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(structural_tag=spec)


@pytest.mark.parametrize("spec, message", [
    (fmt({"type": "dispatch", "rules": []}), r"structural_tag.format.type 'dispatch' is not supported"),
    (fmt(schema(CITY) | {"style": "qwen_xml"}), r"structural_tag.format.style 'qwen_xml' is not supported"),
    (fmt({"type": "sequence", "elements": [ANY, schema(CITY)]}),
     r"structural_tag.format.elements\[0\]: any_text must end the output or be followed by a string"),
    (fmt({"type": "triggered_tags", "triggers": ["<g="], "tags": [CALL_CITY]}),
     r"structural_tag.format.tags\[0\].begin must start with exactly one of the triggers"),
    ({"type": "structural_tag", "triggers": ["<x"], "structures": [{"begin": "<f=a>", "schema": {}, "end": ""}]},
     r"structural_tag.structures\[0\].begin must start with one of the triggers \['<x'\]"),
    (fmt({"type": "repeat", "min": 3, "max": 1, "content": const("a")}), "repeat needs 0 <= min <= max"),
    (fmt(tag({"type": "token", "token": "<|no such token|>"}, ANY, "x")), "must be a token id or a token"),
    (fmt({"type": "sequence", "elements": []}), r"structural_tag.format.elements must be a non-empty list"),
    (fmt(tag("<|python|>", ANY, "")), r"structural_tag.format.content: any_text must end the output or be followed"),
    (fmt(const("a") | {"values": 1}), "unknown field"),
    (fmt({"type": "regex", "pattern": "("}), "invalid structural_tag"),
])
def test_bad_formats_are_named_when_compiled(compiler, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(StructuredOutput(structural_tag=spec))


def test_openai_and_vllm_spellings() -> None:
    """response_format (both spellings) and structured_outputs.structural_tag (vLLM sends
    JSON text) all give one constraint; StructuredOutputsParams ports unchanged."""
    expected = StructuredOutput(structural_tag=LEGACY)
    assert structured_output_from_openai(LEGACY) == expected
    assert structured_output_from_openai(structured_outputs={"structural_tag": json.dumps(LEGACY)}) == expected
    assert SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(LEGACY))
                          ).structured == expected
    assert structured_output_from_openai(fmt(ANY)) == StructuredOutput(structural_tag=fmt(ANY))
    with pytest.raises(ValueError, match="response_format: structural_tag needs either"):
        structured_output_from_openai({"type": "structural_tag"})


# -- the default model under the constraint --------------------------------------------

@pytest.fixture(scope="module")
def model_reference(tmp_path_factory) -> XGrammarReference:
    engine = default_engine()
    path = tmp_path_factory.mktemp("default-tokenizer") / "tokenizer.json"
    path.write_text(engine.tokenizer.backend.to_str())
    return XGrammarReference(str(path), eos=engine.eos_token_ids[0])


def _calls(text: str) -> list[tuple[str, dict]]:
    return [(name, json.loads(body)) for name, body in re.findall(r"<f=(\w+)>(.*?)</f>", text, re.S)]


def test_generation_follows_the_tags(model_reference) -> None:
    """Forced calls (at_least_one, stop_after_first) greedy and sampled, and free text with
    optional calls: every finished output is a whole output to xgrammar (a cut one a
    prefix of one), and each call's JSON validates under its tool's schema."""
    llm = default_llm()
    forced = fmt({**TRIGGERED, "at_least_one": True, "stop_after_first": True})
    free = LEGACY
    prompt = chat_prompt(llm.engine, "What is the weather in Oslo? Call the city function.")
    requests = {
        "greedy": SamplingParams(max_tokens=40, structured=StructuredOutput(structural_tag=forced)),
        "sampled": SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3,
                                  structured=StructuredOutput(structural_tag=forced)),
        "free": SamplingParams(max_tokens=24, temperature=0.8, seed=5, n=2,
                               structured=StructuredOutput(structural_tag=free)),
    }
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 3, list(requests.values()), use_tqdm=False)
    finals = dict(zip(requests, outputs, strict=True))
    schemas = {"city": CITY, "ping": EMPTY}
    for request_id, spec in (("greedy", forced), ("sampled", forced), ("free", free)):
        for completion in finals[request_id].outputs:
            text = completion.text
            if completion.finish_reason == "stop":
                assert model_reference.accepts(spec, text), (request_id, text)
            else:
                assert model_reference.accepts_prefix(spec, text), (request_id, text)
            for name, arguments in _calls(text):
                jsonschema.validate(arguments, schemas[name])
    for completion in finals["greedy"].outputs + finals["sampled"].outputs:
        assert completion.finish_reason == "stop" and len(_calls(completion.text)) == 1


# -- any spec: compiled, or refused with a ValueError ----------------------------------

_texts = st.text(alphabet=st.sampled_from("ab<>=/{}\"\\\n é"), max_size=6)
_leaves = st.one_of(
    st.fixed_dictionaries({"type": st.just("const_string"), "value": _texts}),
    st.fixed_dictionaries({"type": st.just("any_text")}, optional={"excludes": st.lists(_texts, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.sampled_from(
        [CITY, EMPTY, {}, True, False, {"type": "integer", "maximum": 9}, {"type": "nope"}])}),
    st.fixed_dictionaries({"type": st.just("regex"), "pattern": st.sampled_from(["[0-9]+", "a|b", "(", "", "x*"])}),
    st.fixed_dictionaries({"type": st.just("token"), "token": st.one_of(st.integers(-1, 600), _texts)}),
    st.fixed_dictionaries({"type": st.sampled_from(["dispatch", "qwen_xml_parameter", 3])}),
)


def _extend(children):
    lists = st.lists(children, max_size=3)
    tags = st.lists(st.fixed_dictionaries({"type": st.just("tag"), "begin": _texts, "content": children,
                                           "end": st.one_of(_texts, st.lists(_texts, max_size=2))}), max_size=3)
    flags = {"at_least_one": st.booleans(), "stop_after_first": st.booleans()}
    return st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["sequence", "or"]), "elements": lists}),
        st.fixed_dictionaries({"type": st.just("tag"), "begin": _texts, "content": children,
                               "end": st.one_of(_texts, st.lists(_texts, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("triggered_tags"), "triggers": st.lists(_texts, max_size=2),
                               "tags": tags}, optional=flags),
        st.fixed_dictionaries({"type": st.just("tags_with_separator"), "tags": tags, "separator": _texts},
                              optional=flags),
        st.fixed_dictionaries({"type": st.sampled_from(["optional", "plus", "star"]), "content": children}),
        st.fixed_dictionaries({"type": st.just("repeat"), "content": children, "min": st.integers(-1, 3),
                               "max": st.integers(-2, 3)}),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(_leaves, _extend, max_leaves=8))
def test_any_format_compiles_or_is_refused_by_name(compiler, format_) -> None:
    """Whatever the tree, compiling it gives a grammar or a ValueError naming a field
    (the server's 400), never another exception (a 500)."""
    try:
        compiler.compile(StructuredOutput(structural_tag=fmt(format_)))
    except ValueError as error:
        assert "structural_tag" in str(error), error
