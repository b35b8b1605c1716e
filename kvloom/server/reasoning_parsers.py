"""Reasoning parsers: a thinking model's output split into its reasoning and its answer
(vLLM's ``--reasoning-parser``; the chat response's ``reasoning`` beside ``content``).

Every format here is DeepSeek R1's: the reasoning ends at ``</think>``, and the chat
template has opened it, so the output begins inside it; a ``<think>`` the model writes
first anyway is dropped. They differ in when the template opens it: R1's and MiniMax
M2's always, Qwen3's unless the request sets ``chat_template_kwargs.enable_thinking``
false, DeepSeek V3.1's only where it sets ``thinking`` (or ``enable_thinking``) true; an
output of a request that does not think is all content. An output without ``</think>``
(cut by ``max_tokens``, say) is reasoning only, as vLLM's. The text after ``</think>`` is
the content, which a tool-call parser then reads; a constraint (response_format, a
forced tool call) applies to it alone (serving_chat.after_reasoning).

``ReasoningStream`` is one incremental machine, and splitting a whole output is that
machine fed the whole text: streamed in any pieces, the reasoning and the content
concatenate to the whole output's split. A piece that may be the start of a marker is
held back until the next piece (or the end) shows whether it is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloom.server.tool_call_stream import held_marker_prefix

if TYPE_CHECKING:
    from kvloom.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The markers around a model's reasoning, and how a request turns the thinking on
    or off through the template: the ``template_switches`` it may set, and whether it
    thinks where it sets none (``thinks_by_default``)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    template_switches: tuple[str, ...] = ()
    thinks_by_default: bool = True

    def thinks(self, template_kwargs: dict[str, object]) -> bool:
        """Whether an output of a request rendered with ``template_kwargs`` opens in its
        reasoning: a switch set to false turns a thinking-by-default format off (Qwen3's
        ``enable_thinking``), one set to true turns the others on (V3.1's ``thinking``)."""
        given = [template_kwargs[switch] for switch in self.template_switches if switch in template_kwargs]
        if not given:
            return self.thinks_by_default
        if self.thinks_by_default:
            return all(value is not False for value in given)
        return any(bool(value) for value in given)


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1"),
    "deepseek_v3": ReasoningFormat("deepseek_v3", template_switches=("thinking", "enable_thinking"),
                                   thinks_by_default=False),
    "minimax_m2": ReasoningFormat("minimax_m2"),
    "qwen3": ReasoningFormat("qwen3", template_switches=("enable_thinking",)),
}


def get_reasoning_parser(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]


def check_vocabulary(reasoning: ReasoningFormat, tokenizer: Tokenizer) -> None:
    """ValueError unless each marker is one token of the model that its decoded text
    keeps (not a special token, which the text leaves out): as vLLM, a model without
    them is refused when it loads rather than answered with reasoning it cannot mark."""
    for marker in (reasoning.start, reasoning.end):
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise ValueError(f"--reasoning-parser {reasoning.name} needs {marker!r} as a token of the model's "
                             "vocabulary, which has none: this is not a thinking model of that format")
        if tokenizer.is_special(token_id):
            raise ValueError(f"--reasoning-parser {reasoning.name}: {marker!r} (token {token_id}) is a special "
                             "token, which the decoded text leaves out")


class ReasoningStream:
    """One output's text, piece by piece, into (reasoning, content) pieces.

    States: ``opening`` (nothing emitted yet: a leading start marker is dropped),
    ``reasoning`` (until the end marker), ``content`` (the rest), entered at
    ``content`` for an output that does not think. ``held`` is text that may be the
    start of the marker the state looks for."""

    def __init__(self, reasoning: ReasoningFormat, thinking: bool) -> None:
        self.format = reasoning
        self.state = "opening" if thinking else "content"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        if self.state == "opening":
            start = self.format.start
            if text.startswith(start):
                text = text[len(start):]
            elif start.startswith(text):  # all of it may still be the marker
                self.held = text
                return "", ""
            self.state = "reasoning"
        if self.state == "reasoning":
            end = text.find(self.format.end)
            if end < 0:
                keep = held_marker_prefix(text, self.format.end)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self.state = "content"
            return text[:end], text[end + len(self.format.end):]
        return "", text

    def split(self, text: str, last: bool) -> tuple[str, str]:
        """``feed(text)``, and where ``text`` is the output's last piece, ``finish()``
        after it: this piece's (reasoning, content)."""
        thought, content = self.feed(text)
        if last:
            rest = self.finish()
            thought, content = thought + rest[0], content + rest[1]
        return thought, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end of the output: reasoning (an unfinished marker is text)."""
        held, self.held = self.held, ""
        return ("", held) if self.state == "content" else (held, "")


def split_reasoning(reasoning: ReasoningFormat, text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None where empty (as vLLM's)."""
    stream = ReasoningStream(reasoning, thinking)
    first, second = stream.feed(text), stream.finish()
    return first[0] + second[0] or None, first[1] + second[1] or None
