"""Compile ``StructuredOutput`` constraints into llguidance grammars, once per text.

A ``CompiledGrammar`` is a validated grammar plus a pristine matcher; each request
gets a ``deep_copy`` of that matcher (microseconds), so a schema shared by many
requests is parsed and checked once. Compiled grammars live in an LRU keyed by
``StructuredOutput.cache_key`` = (kind, text).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance

from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.structural_tag import structural_tag_grammar
from kvloom.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON output is compact (no free whitespace) unless a schema opts in with
# {"x-guidance": {"whitespace_flexible": true}}: small models given free whitespace
# can emit newlines forever, and compact keys are what jump-forward can force.
JSON_COMPILE_DEFAULTS = {"whitespace_flexible": False}

_SOURCE_EXCERPT = re.compile(r"^\s*\d+ \|")


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A validated llguidance grammar; ``new_matcher()`` starts a request on it."""

    key: tuple[str, str]
    grammar: str  # llguidance's serialised grammar
    template: llguidance.LLMatcher  # never advanced: only copied

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class GrammarCompiler:
    """Turns constraints into ``CompiledGrammar`` for one tokenizer and vocabulary.

    ``vocab_size`` is the model's (the logits' width), which may exceed the
    tokenizer's: the extra ids are never allowed. EOS ids are those the engine stops
    on, so a grammar's end is a token the scheduler recognises.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 128) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs at least one EOS token id")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(self.eos_token_ids))
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """The constraint's grammar, from the cache when its (kind, text) was seen.

        Raises ValueError naming the constraint kind and llguidance's reason for an
        invalid schema / regex / grammar or an unsupported JSON Schema feature.
        """
        key = constraint.cache_key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        compiled = self._compile(constraint)
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        self.num_compiled += 1
        return compiled

    def _compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        kind, text = constraint.cache_key
        grammar = (structural_tag_grammar(text, self.tokenizer.token_to_id, self.vocab_size)
                   if kind == "structural_tag" else _to_llguidance(kind, text))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=self.limits)
        if is_error:
            raise ValueError(f"invalid {kind}: {_reason(messages[0])}")
        for warning in messages:
            logger.warning("structured output %s: %s", kind, warning)
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if template.is_error():  # validated above; kept as a guard against library drift
            raise ValueError(f"invalid {kind}: {_reason(template.get_error())}")
        self._probe(kind, template)
        return CompiledGrammar((kind, text), grammar, template)

    def _probe(self, kind: str, template: llguidance.LLMatcher) -> None:
        """Run the grammar one token on a copy: its first mask, then the first token that
        mask allows. A grammar that explodes only when it is run (nested repeats such as
        ``(a{1000}){1000}``) hits llguidance's limits here, at admission and in bounded
        time, instead of failing the request mid-generation. (Should one explode later
        still, the engine fails that request alone.)"""
        probe = template.deep_copy()
        mask = probe.compute_bitmask()
        if probe.is_error() and "NoExtensionBias" in probe.get_error():
            # llguidance's word for a first mask with nothing in it: the language is
            # empty (``[^\s\S]``, ``[a&&b]``), so no output, not even an empty one, fits.
            raise ValueError(f"{kind} matches no text at all: no output can satisfy it")
        if not probe.is_error():
            allowed = next((word * 32 + bit for word, bits in enumerate(memoryview(mask).cast("I"))
                            if bits for bit in range(32) if bits >> bit & 1
                            and word * 32 + bit not in self.eos_token_ids), None)
            if allowed is not None:
                probe.consume_token(allowed)
        if probe.is_error():
            raise ValueError(f"{kind} too complex to follow: {_reason(probe.get_error())}")


def _to_llguidance(kind: str, text: str) -> str:
    """The constraint as llguidance's grammar description (not yet validated)."""
    if kind in ("json_schema", "json_object"):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_COMPILE_DEFAULTS)
        except ValueError as error:
            raise ValueError(f"invalid {kind}: {error}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # JSON string literals are valid Lark string literals (same escapes). One
        # terminal (upper-case name) is one lexeme: the options become a single
        # automaton in the lexer, so thousands of them cost no parser row per option
        # (llguidance's parser caps a row at 2,000 items).
        # DEL is the one character JSON leaves raw that the lexer refuses: escaped too.
        options = " | ".join(json.dumps(option, ensure_ascii=False).replace("\x7f", "\\u007f")
                             for option in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}")
    if kind == "grammar":
        try:
            # Accepts Lark as is and converts GBNF (llama.cpp's `root ::= ...`).
            return llguidance.grammar_from("grammar", text)
        except ValueError as error:
            raise ValueError(f"invalid grammar: {error}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


def _reason(message: str) -> str:
    """llguidance's message without the grammar-source excerpt it may append
    (lines like ``   1 | start: ...``): the reason comes before it."""
    lines: list[str] = []
    for line in message.strip().splitlines():
        if _SOURCE_EXCERPT.match(line):
            break
        if line.strip():
            lines.append(line.rstrip())
    return "\n".join(lines) or message
