"""Tokenizer wrapper: encode/decode, chat templates, incremental detokenization.

Everything is built on the ``tokenizers`` library, from a ``tokenizer.json`` or from
the vocabulary embedded in a GGUF file. transformers' ``AutoTokenizer`` is avoided on
purpose: a saved ``tokenizer_config.json`` may name a slow ``LlamaTokenizer`` class
while the ``tokenizer.json`` next to it is byte-level BPE, and the JSON is the truth.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNUSED, _GGUF_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns, keyed by GGUF ``tokenizer.ggml.pre``. They follow
# llama.cpp's table, which is the one a GGUF's tokenizer was validated against.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2_PRES = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRES = {"llama-bpe", "llama3", "smaug-bpe", "falcon3", "tekken", "lfm2"}
_QWEN2_PRES = {"qwen2", "stablelm2", "deepseek-r1-qwen"}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the facts an engine needs: BOS/EOS ids,
    whether to add BOS, which ids are special, and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        # None: trust the tokenizer.json post-processor; a bool overrides it (as
        # tokenizer_config.json's add_bos_token does in transformers).
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self.special_tokens.update({k: v for k, v in
                                    (("bos_token", bos_token), ("eos_token", eos_token)) if v})
        eos_ids: list[int] = []
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        eos_ids.extend(extra_eos_token_ids)
        eos_ids.extend(self._template_turn_end_ids())
        # Order kept (the primary EOS first) so callers may use eos_token_ids[0].
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))

    def override_chat_template(self, template: str) -> None:
        """Use ``template`` (``--chat-template``: a file path or inline Jinja, see
        ``resolve_chat_template``) instead of the tokenizer's own; the special token it
        writes after an assistant turn becomes an EOS too, as for a loaded template."""
        source = resolve_chat_template(template)
        try:
            _compile_template(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat_template is not a valid Jinja template: {error}") from None
        self.chat_template = source
        self.eos_token_ids = tuple(dict.fromkeys(self.eos_token_ids + tuple(self._template_turn_end_ids())))

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, tokenizer_json: Path | str, config: dict[str, Any] | None = None,
                  *, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load ``tokenizer.json``; ``config`` is the parsed ``tokenizer_config.json``
        (special tokens, ``chat_template``, ``add_bos_token``), if any."""
        config = config or {}
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        add_bos = config.get("add_bos_token")
        special = {k: _token_content(v) for k, v in config.items()
                   if k.endswith("_token") and k != "add_bos_token" and k != "add_eos_token"}
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=template,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            extra_eos_token_ids=extra_eos_token_ids,
            special_tokens={k: v for k, v in special.items() if isinstance(v, str)},
        )

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``:
        what ``from_file`` reads back."""
        self.backend.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config(), indent=1))

    def config(self) -> dict[str, Any]:
        """What ``tokenizer_config.json`` says of this tokenizer, as transformers writes
        it: the special tokens, ``add_bos_token``, the added tokens by id and the chat
        template (the class is transformers' for a ``tokenizer.json``)."""
        added = {str(token_id): {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                                 "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}
                 for token_id, token in sorted(self.backend.get_added_tokens_decoder().items())}
        return {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens,
                "add_bos_token": self.add_bos_token, "added_tokens_decoder": added,
                "chat_template": self.chat_template}

    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> Tokenizer:
        """Build from a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` metadata: byte-level
        BPE (``gpt2``) or SentencePiece-style BPE with byte fallback (``llama``)."""
        meta = _GGUFMeta(reader)
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [],
                                      meta.get("tokenizer.ggml.pre") or "default")
            default_add_bos = False
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk_id = meta.get("tokenizer.ggml.unknown_token_id")
            backend = _sentencepiece_bpe(tokens, scores, types, unk_id,
                                         meta.get("tokenizer.ggml.add_space_prefix", True))
            default_add_bos = True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                            for tok, t in zip(tokens, types, strict=True) if t == _GGUF_USER_DEFINED])
        backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                    for tok, t in zip(tokens, types, strict=True)
                                    if t in (_GGUF_CONTROL, _GGUF_UNKNOWN)])

        def token_at(key: str) -> str | None:
            idx = meta.get(key)
            return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

        extra = [meta.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            extra_eos_token_ids=[i for i in extra if isinstance(i, int)],
            special_tokens={"unk_token": token_at("tokenizer.ggml.unknown_token_id"),
                            "pad_token": token_at("tokenizer.ggml.padding_token_id")},
        )

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Encode a rendered chat prompt with
        ``add_special_tokens=False``: templates write their own BOS."""
        if self.add_bos_token is None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Token ids of two texts as one input, as transformers' ``tokenizer(text, pair)``
        makes them (a cross-encoder's query and document): the tokenizer's pair template
        where it has one, else each text as ``encode`` makes it (a BOS each where it
        adds one, as transformers' Llama tokenizers do), one after the other."""
        if self.add_bos_token is None:
            return self.backend.encode(text, pair, add_special_tokens=True).ids
        return self.encode(text) + self.encode(pair)

    def encode_score_pair(self, query: str, document: str, template: str, **kwargs: Any) -> list[int]:
        """Token ids of a cross-encoder's pair through a score template (vLLM's): the
        template renders the messages ``[{"role": "query", ...}, {"role": "document",
        ...}]`` (no generation prompt; ``kwargs`` are its variables, e.g. ``instruction``),
        and the text is encoded with the special tokens, as vLLM encodes it. A template
        that fails to render raises ValueError with the template's reason."""
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            text = self.apply_chat_template(messages, add_generation_prompt=False, chat_template=template, **kwargs)
        except jinja2.TemplateError as error:
            raise ValueError(f"the score template failed to render the pair: {error}") from None
        return self.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ------------------------------------------------------------ chat template
    def role_markers(self, role: str) -> tuple[str, str]:
        """The text the chat template writes before and after a ``role`` message's
        content (kvloom.lang's ``system`` / ``user`` / ``assistant``). Rendered after a
        system message, so that a template that inserts a default system message when
        none leads does not put it into every role."""
        sentinel = "\x00kvloom-role\x00"
        lead = [] if role == "system" else [{"role": "system", "content": "x"}]
        base = self.apply_chat_template(lead, add_generation_prompt=False) if lead else ""
        rendered = self.apply_chat_template([*lead, {"role": role, "content": sentinel}],
                                            add_generation_prompt=False)
        if not rendered.startswith(base) or rendered.count(sentinel) != 1:
            raise ValueError(f"the chat template renders a {role!r} message in a way that cannot be split "
                             "into the text before and after its content")
        before, after = rendered[len(base):].split(sentinel)
        return before, after

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` with the model's Jinja chat template (or ``chat_template``,
        one given for this call), as transformers does (sandboxed,
        ``trim_blocks``/``lstrip_blocks``, ``raise_exception``; ``documents`` and extra
        ``kwargs`` are template variables). ``continue_final_message`` cuts the text
        right after the last message's content, so generation continues that message
        (transformers' rule: its last occurrence, stripped if not found as is)."""
        if chat_template is not None:
            try:
                template = _compile_template(chat_template)
            except jinja2.TemplateError as error:
                raise ValueError(f"chat_template is not a valid Jinja template: {error}") from None
        elif not self.chat_template:
            raise ValueError("this model has no chat template; use a plain completion "
                             "prompt instead of chat messages")
        else:
            template = _compile_template(self.chat_template)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        context = {**self.special_tokens, **kwargs}
        text: str = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, documents=documents, **context)
        if not continue_final_message:
            return text
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a final message with text content")
        for needle in (final, final.strip()):
            if needle in text:
                return text[: text.rindex(needle) + len(needle)]
        raise ValueError("continue_final_message: the template did not render the final "
                         "message's content")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        """Render then tokenize a chat, by default without adding a second BOS (the
        template writes its own; ``add_special_tokens``: the tokenizer's on top, vLLM's)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def _template_turn_end_ids(self) -> list[int]:
        """Ids of the special token that the template writes after an assistant turn
        (``<|im_end|>``, ``<|eot_id|>``...): generation must stop on it too."""
        if not self.chat_template:
            return []
        marker = "kvloom-turn-marker-7f3a"
        try:
            text = self.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                add_generation_prompt=False)
        except Exception:  # a template may insist on other roles; the guess is optional
            return []
        after = text[text.find(marker) + len(marker):] if marker in text else ""
        ids = self.backend.encode(after, add_special_tokens=False).ids if after else []
        return ids[:1] if ids and self.is_special(ids[0]) else []


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting characters.

    It decodes a short window of recent ids (``prefix_offset:``) and emits only the
    text past the previous window (``read_offset``), and only when that text does not
    end in U+FFFD, i.e. a multi-byte character is complete. Invariant: ``text`` (all
    deltas, plus ``finish()``) equals ``decode(prompt + output)`` less the decoded
    prompt; for byte-level BPE that is ``decode(output)``. (SentencePiece decoders drop
    the space before the first word of a sequence; mid-stream it is kept.)"""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.text = ""
        self.read_offset = len(self.token_ids)
        # A few prompt tokens of context, so decoders that treat the first token
        # specially (leading-space stripping) see a mid-sequence window. Start on a
        # character boundary: a window that opens mid-character decodes to U+FFFD.
        start = max(self.read_offset - 5, 0)
        while start > 0 and self._decode(start, self.read_offset).startswith("\ufffd"):
            start -= 1
        self.prefix_offset = start

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the newly completed text (may be empty)."""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back for an incomplete character (at end of stream)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


# ---------------------------------------------------------------- chat templates
class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by some templates to
    mark assistant spans for training masks); we render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)




def resolve_chat_template(value: str) -> str:
    """A template's source from ``--chat-template``: the file's text when ``value`` names
    an existing file, else ``value`` itself when it is Jinja (holds ``{{`` or ``{%``)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a long inline template is no valid file name
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither an existing file nor a Jinja template")


@functools.lru_cache(maxsize=64)  # models' templates, and those requests bring (--trust-request-chat-template)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ------------------------------------------------------------ GGUF vocabularies
def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are either strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class _GGUFMeta:
    """Reads GGUF metadata fields as Python values, with defaults."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.item() if hasattr(value, "item") else value


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str],
                    pre: str) -> tokenizers.Tokenizer:
    # Byte-level vocabularies spell every byte as one printable character; a normal
    # token written in plain text (some converters do) is re-spelled so BPE finds it.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _byte_spelling()
    vocab = {
        tok if t != _GGUF_NORMAL or set(tok) <= alphabet
        else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRES else _QWEN2_PATTERN
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        if pre not in _GPT2_PRES and pre not in _DIGIT_SPLIT_PRES:
            logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2's split rules", pre)
        gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
            if pre in _DIGIT_SPLIT_PRES else gpt2)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves,
    the rest map to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return spelling


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int],
                       unk_id: int | None, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece vocabularies carry scores, not merges: a merge (a, b) exists when
    a+b is in the vocabulary, ranked by the merged piece's score (higher first)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = {tok for tok, t in zip(tokens, types, strict=True)
                 if t in (_GGUF_NORMAL, _GGUF_USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for tok in mergeable:
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[vocab[tok]], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[(r[3], r[4]) for r in ranked], unk_token=unk,
        fuse_unk=True, byte_fallback=True))
    # Metaspace marks spaces as U+2581 and prefixes the first word, as HF's Llama
    # tokenizer does; split=False keeps the text whole, as SentencePiece does.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    return backend
