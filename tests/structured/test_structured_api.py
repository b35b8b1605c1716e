"""The constraint object, the OpenAI-field conversion, compilation and its cache, and
the sampler's mask stage: no model needed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kvloom import SamplingParams
from kvloom.runner.sampler import Sampler, apply_token_bitmask
from kvloom.runner.sampling_metadata import SamplingMetadata, SamplingRequestState
from kvloom.structured import StructuredOutput, structured_output_from_openai
from kvloom.structured.compiler import GrammarCompiler
from kvloom.structured.mask import GrammarMask
from kvloom.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    tokenizer = Tokenizer.from_file(tiny_llama / "tokenizer.json")
    return GrammarCompiler(tokenizer, vocab_size=512, eos_token_ids=[2], cache_size=3)


def test_exactly_one_kind_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one of json_schema, json_object, regex, grammar, choice"):
        StructuredOutput()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutput(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="json_object must be a bool"):
        StructuredOutput(json_object="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema must be a JSON object"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(grammar=3), "grammar must be a non-empty string"),
    (dict(choice="abc"), "choice must be a list of strings"),
    (dict(choice=[]), "choice must contain at least one string"),
    (dict(choice=["a", ""]), "choice must contain non-empty strings"),
])
def test_bad_values_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)


def test_sampling_params_validates_the_field() -> None:
    with pytest.raises(ValueError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"regex": "a"})  # type: ignore[arg-type]
    params = SamplingParams(structured=StructuredOutput(choice=["x", "y"]))
    assert params.structured.kind == "choice"


@pytest.mark.parametrize(("vllm_spelling", "ours"), [
    ({"json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"grammar": 'start: "a"+'}, {"grammar": 'start: "a"+'}),
    ({"json_object": True}, {"json_object": True}),
])
def test_vllm_structured_outputs_params_port_unchanged(vllm_spelling, ours) -> None:
    """vLLM's SamplingParams(structured_outputs=StructuredOutputsParams(...)) sets the
    same constraint as ours, and survives dataclasses.replace (the n > 1 fan-out)."""
    import dataclasses

    from kvloom import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(**vllm_spelling))
    assert params.structured == StructuredOutput(**ours)
    assert dataclasses.replace(params, n=2).structured == StructuredOutput(**ours)


def test_vllm_structured_outputs_params_errors() -> None:
    from kvloom import StructuredOutputsParams

    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured=StructuredOutput(regex="a"), structured_outputs=StructuredOutputsParams(regex="b"))
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))


def test_cache_key_is_kind_and_normalised_text() -> None:
    as_dict = StructuredOutput(json_schema=SCHEMA)
    as_text = StructuredOutput(json_schema=json.dumps(SCHEMA, indent=2))
    compact = json.dumps(SCHEMA, separators=(",", ":"))
    assert as_dict.cache_key == as_text.cache_key == ("json_schema", compact)
    assert StructuredOutput(json_object=True).cache_key == ("json_object", '{"type":"object"}')
    assert StructuredOutput(choice=["é", "b"]).text == '["é", "b"]'
    # jump_forward is a decoding choice, not part of the grammar.
    assert StructuredOutput(regex="a", jump_forward=False).cache_key == StructuredOutput(regex="a").cache_key


def test_openai_fields() -> None:
    convert = structured_output_from_openai
    assert convert(None) is None
    assert convert({"type": "text"}) is None
    assert convert({"type": "json_object"}) == StructuredOutput(json_object=True)
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert convert(schema_format) == StructuredOutput(json_schema=SCHEMA)
    assert convert(guided_json=json.dumps(SCHEMA)) == StructuredOutput(json_schema=SCHEMA)
    assert convert(guided_regex="[0-9]+") == StructuredOutput(regex="[0-9]+")
    assert convert(guided_choice=["a", "b"]) == StructuredOutput(choice=["a", "b"])
    assert convert(guided_grammar='root ::= "a"') == StructuredOutput(grammar='root ::= "a"')
    assert convert(structured_outputs={"regex": "b+"}) == StructuredOutput(regex="b+")
    # A pydantic-like object is dumped first.
    model = SimpleNamespace(model_dump=lambda **_: {"type": "json_object"})
    assert convert(model) == StructuredOutput(json_object=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(response_format={"type": "xml"}), "response_format.type must be one of"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema must be an object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema is required"),
    (dict(response_format="json"), "response_format must be an object"),
    (dict(response_format={"type": "json_object"}, guided_regex="a"),
     "only one structured output constraint may be given, got response_format, guided_regex"),
    (dict(guided_json="{oops"), "guided_json: json_schema is not valid JSON"),
    (dict(guided_choice=[]), "guided_choice: choice must contain at least one string"),
])
def test_openai_fields_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        structured_output_from_openai(**kwargs)


def test_compile_is_cached_by_kind_and_text(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutput(json_schema=SCHEMA))
    assert compiler.compile(StructuredOutput(json_schema=json.dumps(SCHEMA))) is first
    assert compiler.num_compiled == before + 1
    # Same text, different kind: a different grammar.
    compiler.compile(StructuredOutput(regex="a"))
    compiler.compile(StructuredOutput(choice=["a"]))
    assert compiler.num_compiled == before + 3
    # LRU of 3: a fourth entry evicts the least recently used (the schema was used last
    # before regex and choice... so touch it, then the regex is the oldest).
    compiler.compile(StructuredOutput(json_schema=SCHEMA))
    compiler.compile(StructuredOutput(grammar='start: "x"'))
    assert compiler.compile(StructuredOutput(json_schema=SCHEMA)) is first
    compiler.compile(StructuredOutput(regex="a"))
    assert compiler.num_compiled == before + 5


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutput(json_schema={"type": "object", "if": {}, "then": {}}), r'invalid json_schema: .*"if"'),
    (StructuredOutput(json_schema={"type": "strin"}), "invalid json_schema: .*strin"),
    (StructuredOutput(regex="[a-"), "(?s)invalid regex: .*unclosed character class"),
    (StructuredOutput(grammar='root ::= "a" | undefined'), "invalid grammar: .*undefined"),
    (StructuredOutput(grammar="start: x y"), "invalid grammar: .*"),
    # Valid syntax, empty language: no text at all matches (was "too complex to follow").
    (StructuredOutput(regex="[^\\s\\S]"), "^regex matches no text at all"),
    (StructuredOutput(regex="[a&&b]"), "^regex matches no text at all"),
])
def test_compile_errors_are_clear(compiler: GrammarCompiler, constraint, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        compiler.compile(constraint)
    assert "<state>" not in str(info.value) and len(str(info.value)) < 400


def test_token_bitmask_masks_only_constrained_rows() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)  # row 1 allows tokens 5, 40 and 69
    for token in (5, 40, 69):
        bitmask[0, token // 32] |= 1 << (token % 32)
    masked = apply_token_bitmask(logits.clone(), GrammarMask(torch.tensor([1]), bitmask))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [5, 40, 69]
    # The sign bit (token 31 of a word) works like any other.
    bitmask = torch.tensor([[-(1 << 31) | 1, 0, 0]], dtype=torch.int32)  # bits 31 and 0
    masked = apply_token_bitmask(logits.clone(), GrammarMask(torch.tensor([0]), bitmask))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 31]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_only_picks_allowed_tokens(temperature: float) -> None:
    vocab = 64
    params = SamplingParams(temperature=temperature, top_p=0.9, min_tokens=3)
    constrained = SamplingParams(temperature=temperature, top_p=0.9, min_tokens=3,
                                 structured=StructuredOutput(regex="a"))
    rows = [SamplingRequestState(p, [1], [], None, (2,)) for p in (params, constrained)]
    # Row 1 allows only EOS (2): min_tokens must not block it, or nothing would be left.
    bitmask = torch.tensor([[1 << 2, 0]], dtype=torch.int32)
    metadata = SamplingMetadata.build(rows, vocab, torch.device("cpu"),
                                      GrammarMask(torch.tensor([1]), bitmask))
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(20):
        tokens = sampler(torch.randn(2, vocab), metadata).token_ids
        assert tokens[1] == 2 and tokens[0] != 2


def test_choices_with_control_characters_compile_and_match(compiler: GrammarCompiler) -> None:
    """Each option is matched as the text it is: DEL (which JSON leaves raw and the
    grammar's lexer refused: "invalid choice: lexer error"), NUL, a C1 control, quotes."""
    options = ["a\x7fb", "\x00", "c\x9f", 'say "hi"\\', "plain"]
    constraint = StructuredOutput(choice=options)
    for option in options:
        matcher = compiler.compile(constraint).new_matcher()
        assert matcher.consume_tokens(compiler.ll_tokenizer.tokenize_str(option)) and matcher.is_accepting(), option
    matcher = compiler.compile(constraint).new_matcher()
    assert not (matcher.consume_tokens(compiler.ll_tokenizer.tokenize_str("ab")) and matcher.is_accepting())
