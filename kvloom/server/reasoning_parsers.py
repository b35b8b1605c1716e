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

GPT-OSS's harmony format (``openai_gptoss``, vLLM's name) is a third shape with a machine
of its own (``HarmonyStream``): the output is a sequence of messages, each a header
(``<|channel|>analysis``, after the first ``<|start|>assistant<|channel|>final``, a
recipient `` to=functions.NAME`` for a tool call) then ``<|message|>`` and a body that
``<|end|>`` (or the stop tokens ``<|return|>``, ``<|call|>``) closes. The analysis channel's
bodies are the reasoning, the final channel's (and commentary without a recipient) the
content; a tool call's message is kept in the content whole, markup included, for the
``openai`` tool-call parser (tool_parsers.py) to read.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloom.server.tool_call_stream import held_marker_prefix

if TYPE_CHECKING:
    from kvloom.tokenizer import Tokenizer


MARKER_KINDS = ("token", "special", "text", "harmony")


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
    decoded with (``skip_special_tokens`` false); ``text``, a phrase of several tokens;
    ``harmony``, GPT-OSS's channels of special tokens (``HarmonyStream``)."""

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
    # The markers each message of it has (HarmonyStream reads the rest).
    "openai_gptoss": ReasoningFormat("openai_gptoss", starts=("<|channel|>",), ends=("<|message|>",),
                                     opened_by_template=False, markers="harmony"),
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
    markers = HARMONY_MARKERS if reasoning.markers == "harmony" else (reasoning.start, reasoning.end)
    for marker in markers:
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise ValueError(f"--reasoning-parser {reasoning.name} needs {marker!r} as a token of the model's "
                             "vocabulary, which has none: this is not a thinking model of that format")
        if tokenizer.is_special(token_id) != (reasoning.markers in ("special", "harmony")):
            raise ValueError(f"--reasoning-parser {reasoning.name}: {marker!r} (token {token_id}) is "
                             + ("not a special token, as this format's marker is"
                                if reasoning.markers in ("special", "harmony")
                                else "a special token, which the decoded text leaves out"))


class OutputSplit(ABC):
    """One output's text, piece by piece, into (reasoning, content) pieces: ``feed`` each
    piece, ``finish`` once at the end (what was held back); ``split`` is both for a piece
    that may be the last."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]: ...

    @abstractmethod
    def finish(self) -> tuple[str, str]: ...

    def split(self, text: str, last: bool) -> tuple[str, str]:
        """``feed(text)``, and where ``text`` is the output's last piece, ``finish()``
        after it: this piece's (reasoning, content)."""
        thought, content = self.feed(text)
        if last:
            rest = self.finish()
            thought, content = thought + rest[0], content + rest[1]
        return thought, content


class ReasoningStream(OutputSplit):
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

    def finish(self) -> tuple[str, str]:
        """What is held at the end of the output, as text of the state it was held in (an
        unfinished marker is text): an output that ends before it could open its own
        reasoning is content."""
        held, self.held = self.held, ""
        as_content = self.state == "content" or (self.state == "opening" and not self.format.opened_by_template)
        return ("", held) if as_content else (held, "")


# ---- GPT-OSS's harmony messages --------------------------------------------------------
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end; the last two stop the output
HARMONY_MARKERS = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, *HARMONY_ENDS)
_HARMONY_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyStream(OutputSplit):
    """One GPT-OSS output's text (decoded with its special tokens), piece by piece, into
    (reasoning, content) pieces: ``ReasoningStream``'s interface.

    States: ``header`` (a message's header, held whole until its ``<|message|>``; text
    there that cannot begin a header, the model writing no harmony at all, is content from
    then on: ``plain``), ``body`` (the message's text, to the sink its header chose, until an
    end marker; a suffix that may begin one is held). ``channel`` is the message's under way
    (None in a header); ``raw``: the message is a tool call, kept in the content with its
    markup."""

    def __init__(self, reasoning: ReasoningFormat, thinking: bool) -> None:
        del reasoning  # the markers are harmony's own
        self.state = "header" if thinking else "plain"
        self.held = ""
        self.channel: str | None = None
        self.raw = False

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        thought: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "plain":
                content.append(text)
                break
            if self.state == "header":
                if not (text.startswith("<|") or "<|".startswith(text)):
                    self.state = "plain"  # no message header: not harmony
                    continue
                end = text.find(HARMONY_MESSAGE)
                if end < 0:
                    self.held = text
                    break
                header, text = text[:end], text[end + len(HARMONY_MESSAGE):]
                name = _HARMONY_CHANNEL_NAME.search(header)
                self.channel = name.group(1) if name is not None else "final"
                self.raw = " to=" in header  # a recipient: a call to a tool (functions.NAME, python, browser)
                if self.raw:
                    content.append(header + HARMONY_MESSAGE)
                self.state = "body"
                continue
            found = [(index, marker) for marker in HARMONY_ENDS if (index := text.find(marker)) >= 0]
            if found:
                end, marker = min(found)
                body, text = text[:end], text[end + len(marker):]
                if self.raw:
                    body += marker
            else:
                keep = max(held_marker_prefix(text, marker) for marker in HARMONY_ENDS)
                body, self.held, text = text[:len(text) - keep], text[len(text) - keep:], ""
            (thought if self.channel == "analysis" and not self.raw else content).append(body)
            if found:
                self.state, self.channel, self.raw = "header", None, False
        return "".join(thought), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a body's unfinished marker is its text; a header the
        output never finished (cut by max_tokens) is dropped, markup and no text."""
        held, self.held = self.held, ""
        if self.state == "body":
            return (held, "") if self.channel == "analysis" and not self.raw else ("", held)
        return ("", held) if self.state == "plain" else ("", "")


def reasoning_stream(reasoning: ReasoningFormat, thinking: bool) -> OutputSplit:
    """The incremental machine that splits one output of ``reasoning``'s format."""
    if reasoning.markers == "harmony":
        return HarmonyStream(reasoning, thinking)
    return ReasoningStream(reasoning, thinking)


def split_reasoning(reasoning: ReasoningFormat, text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None where empty (as vLLM's)."""
    stream = reasoning_stream(reasoning, thinking)
    first, second = stream.feed(text), stream.finish()
    return first[0] + second[0] or None, first[1] + second[1] or None
