"""Reasoning parsers: a thinking model's output split into its reasoning and its answer
(vLLM's ``--reasoning-parser``; the chat response's ``reasoning`` beside ``content``).

Two shapes. DeepSeek R1's (and MiniMax M2's, Qwen3's, DeepSeek V3.1's): the reasoning
ends at ``</think>``, and the chat template has opened it, so the output begins inside
it; a ``<think>`` the model writes first anyway is dropped. They differ in when the
template opens it: R1's and MiniMax M2's always, Qwen3's unless the request sets
``chat_template_kwargs.enable_thinking`` false, DeepSeek V3.1's only where it sets
``thinking`` (or ``enable_thinking``) true; an output of a request that does not think is
all content. Mistral's (Magistral) and IBM Granite's: the model opens its reasoning
itself, with ``[THINK]`` (a special token, kept in the text for this) or the phrase
"Here is my thought process:", and ends it with ``[/THINK]`` or "Here is my response:"
("Here's" too, as vLLM matches); an output that does not begin with the opening marker
is all content. In both shapes an output without the end marker (cut by ``max_tokens``,
say) is reasoning only, as vLLM's. The text after the end marker is the content, which a
tool-call parser then reads; a constraint (response_format, a forced tool call) applies to
it alone (serving_chat.after_reasoning), where the end marker is one token.

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


MARKER_KINDS = ("token", "special", "text")


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The markers around a model's reasoning (each of ``starts`` opens it, each of
    ``ends`` closes it; the first of each is the one a model writes), who opens it, and
    how a request turns the thinking on or off through the template: the
    ``template_switches`` it may set, and whether it thinks where it sets none
    (``thinks_by_default``).

    ``opened_by_template``: the output begins inside the reasoning (a start marker it
    writes first is dropped); otherwise the output must open it with a start marker and
    is all content without one. ``markers``: ``token``, each marker one token the
    decoded text keeps; ``special``, one special token each, which the text must be
    decoded with (``skip_special_tokens`` false); ``text``, a phrase of several tokens."""

    name: str
    starts: tuple[str, ...] = ("<think>",)
    ends: tuple[str, ...] = ("</think>",)
    template_switches: tuple[str, ...] = ()
    thinks_by_default: bool = True
    opened_by_template: bool = True
    markers: str = "token"

    @property
    def start(self) -> str:
        return self.starts[0]

    @property
    def end(self) -> str:
        return self.ends[0]

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
    "mistral": ReasoningFormat("mistral", starts=("[THINK]",), ends=("[/THINK]",), opened_by_template=False,
                               markers="special"),
    "granite": ReasoningFormat("granite", starts=("Here is my thought process:", "Here's my thought process:"),
                               ends=("Here is my response:", "Here's my response:"), opened_by_template=False,
                               markers="text"),
}


def get_reasoning_parser(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]


def check_vocabulary(reasoning: ReasoningFormat, tokenizer: Tokenizer) -> None:
    """ValueError unless each marker is one token of the model (a phrase marker is
    text: nothing to check), special exactly where the format says so (a special
    marker is kept in the text by decoding with the special tokens; another special
    token would be left out of it): as vLLM, a model without them is refused when it
    loads rather than answered with reasoning it cannot mark."""
    if reasoning.markers == "text":
        return
    for marker in (reasoning.start, reasoning.end):
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise ValueError(f"--reasoning-parser {reasoning.name} needs {marker!r} as a token of the model's "
                             "vocabulary, which has none: this is not a thinking model of that format")
        if tokenizer.is_special(token_id) != (reasoning.markers == "special"):
            raise ValueError(f"--reasoning-parser {reasoning.name}: {marker!r} (token {token_id}) is "
                             + ("not a special token, as this format's marker is" if reasoning.markers == "special"
                                else "a special token, which the decoded text leaves out"))


class ReasoningStream:
    """One output's text, piece by piece, into (reasoning, content) pieces.

    States: ``opening`` (nothing emitted yet: a leading start marker is dropped; without
    one, an output the model must open itself is all content), ``reasoning`` (until an
    end marker), ``content`` (the rest), entered at ``content`` for an output that does
    not think. ``held`` is text that may be the start of a marker the state looks for."""

    def __init__(self, reasoning: ReasoningFormat, thinking: bool) -> None:
        self.format = reasoning
        self.state = "opening" if thinking else "content"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        if self.state == "opening":
            start = next((marker for marker in self.format.starts if text.startswith(marker)), None)
            if start is not None:
                text = text[len(start):]
                self.state = "reasoning"
            elif any(marker.startswith(text) for marker in self.format.starts):  # all of it may still be one
                self.held = text
                return "", ""
            else:  # no opening marker: inside the reasoning if the template opened it, else all content
                self.state = "reasoning" if self.format.opened_by_template else "content"
        if self.state == "reasoning":
            found = [(index, marker) for marker in self.format.ends if (index := text.find(marker)) >= 0]
            if not found:
                keep = max(held_marker_prefix(text, marker) for marker in self.format.ends)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self.state = "content"
            end, marker = min(found)
            return text[:end], text[end + len(marker):]
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
        """What is held at the end of the output, as text of the state it was held in (an
        unfinished marker is text): an output that ends before it could open its own
        reasoning is content."""
        held, self.held = self.held, ""
        as_content = self.state == "content" or (self.state == "opening" and not self.format.opened_by_template)
        return ("", held) if as_content else (held, "")


def split_reasoning(reasoning: ReasoningFormat, text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None where empty (as vLLM's)."""
    stream = ReasoningStream(reasoning, thinking)
    first, second = stream.feed(text), stream.finish()
    return first[0] + second[0] or None, first[1] + second[1] or None
