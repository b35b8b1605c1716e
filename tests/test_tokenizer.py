"""Tokenizer: parity with transformers on the SmolLM2 GGUF, chat templates, and the
incremental detokenizer's exactness on multi-byte text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest

from kvloom.models import gguf_loader
from kvloom.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.helpers_models import default_model_path, tiny_tokenizer_json

TEXTS = [
    "Hello world",
    "  leading spaces,\n\nblank lines\tand\ttabs   trailing  ",
    "你好，世界！这是一个测试。机器学习很有趣。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️",
    "mixed: café naïve Ünïcödé — “quotes” … 日本語 한국어",
    "def f(x):\n    return x ** 2  # comment\n",
    "The year 2024 has 365 days; pi is 3.14159.",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "写一首诗 🌸"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def smol(default_gguf_reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(default_gguf_reader)


@pytest.fixture(scope="module")
def hf_smol(smol_path: Path, tmp_path_factory: pytest.TempPathFactory, transformers_gguf_parsed_once: None):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smol")
    (directory / smol_path.name).symlink_to(smol_path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=smol_path.name)


# ----------------------------------------------------- parity with transformers
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text)
    assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True)
    assert smol.decode(ids, skip_special_tokens=False) == hf_smol.decode(ids)
    assert smol.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol: Tokenizer, hf_smol, messages: list[dict],
                                            add_generation_prompt: bool) -> None:
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert smol.encode_chat(messages, add_generation_prompt) == hf_smol.encode(
        theirs, add_special_tokens=False)


def test_smol_special_tokens(smol: Tokenizer, hf_smol) -> None:
    assert smol.vocab_size == len(hf_smol) == 49152
    assert smol.bos_token_id == hf_smol.bos_token_id == 1
    assert smol.eos_token_ids == (hf_smol.eos_token_id,) == (2,)  # <|im_end|> ends turns
    assert smol.is_special(2) and not smol.is_special(100)
    assert smol.id_to_token(2) == "<|im_end|>" and smol.token_to_id("<|im_end|>") == 2
    assert smol.encode("<|im_end|>") == [2]  # special tokens in text are matched whole


def test_digits_split_like_llama_cpp(smol: Tokenizer) -> None:
    """The GGUF's pre-tokenizer is 'smollm': every digit is its own piece."""
    ids = smol.encode("12345")
    assert [smol.decode([i]) for i in ids] == list("12345")


# ---------------------------------------------------------- incremental decode
def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], step: int = 1,
            skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_tokens(output[i:i + step]) for i in range(0, len(output), step)]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS[:5])
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer_exact(smol: Tokenizer, text: str, step: int) -> None:
    prompt = smol.encode_chat([{"role": "user", "content": "说点什么 🙂"}])
    output = smol.encode(text, add_special_tokens=False) + [2]
    deltas = _stream(smol, prompt, output, step)
    assert "".join(deltas) == smol.decode(output) == text
    assert not any("\ufffd" in d for d in deltas)  # never a split character


def test_incremental_detokenizer_holds_partial_characters(smol: Tokenizer) -> None:
    output = smol.encode("😀")
    assert len(output) > 1, "an emoji spans several byte-level tokens"
    detok = IncrementalDetokenizer(smol, [])
    assert [detok.add_tokens([i]) for i in output] == [""] * (len(output) - 1) + ["😀"]


def test_incremental_detokenizer_keeps_special_tokens(smol: Tokenizer) -> None:
    output = smol.encode("答案<|im_end|>", add_special_tokens=False)
    deltas = _stream(smol, [1], output, skip_special_tokens=False)
    assert "".join(deltas) == "答案<|im_end|>"


def test_incremental_detokenizer_flushes_invalid_bytes(smol: Tokenizer) -> None:
    """A model may emit a byte sequence that never becomes valid UTF-8; finish()
    releases it so the stream still equals decode()."""
    emoji = smol.encode("😀")
    output = smol.encode("ok ") + emoji[:1]
    deltas = _stream(smol, [], output)
    assert "".join(deltas) == smol.decode(output)
    assert deltas[-1].endswith("\ufffd")


# ------------------------------------------------------- tokenizer.json + config
@pytest.fixture
def tiny_json(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text(tiny_tokenizer_json())
    return path


def test_from_file_special_tokens_and_bos(tiny_json: Path) -> None:
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"},
              "add_bos_token": True,
              "chat_template": "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['content'] }}"
                               "<|im_end|>{% endfor %}"}
    tokenizer = Tokenizer.from_file(tiny_json, config, extra_eos_token_ids=[0, 2])
    assert tokenizer.vocab_size == 512
    assert tokenizer.bos_token_id == 0
    # eos, the extra ids and <|im_end|> (which ends turns in the template), no repeats.
    assert tokenizer.eos_token_ids == (0, 2)
    ids = tokenizer.encode("hello")
    assert ids[0] == 0 and tokenizer.encode("hello", add_special_tokens=False) == ids[1:]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt.count(0) == 1  # the template's BOS only, not a second one
    assert tokenizer.decode(ids) == "hello"


def test_turn_end_token_detected_from_template(tiny_json: Path) -> None:
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}")
    tokenizer = Tokenizer.from_file(tiny_json, {"eos_token": "<|endoftext|>",
                                                "chat_template": template})
    assert tokenizer.eos_token_ids == (0, 2)


def test_named_chat_templates(tiny_json: Path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "default"}]}
    assert Tokenizer.from_file(tiny_json, config).apply_chat_template([]) == "default"


def test_no_chat_template_is_a_clear_error(tiny_json: Path) -> None:
    tokenizer = Tokenizer.from_file(tiny_json, {})
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_features(tiny_json: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user/assistant') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "  {% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ eos_token }}"
    )
    tokenizer = Tokenizer.from_file(tiny_json, {"chat_template": template,
                                                "eos_token": "<|im_end|>"})
    messages = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "<b>"},
                {"role": "user", "content": "dropped"}]
    # trim_blocks eats the newline after a tag (transformers renders the same);
    # loop controls; non-ASCII, HTML-unescaped JSON.
    assert tokenizer.apply_chat_template(messages) == '  "é"  "<b>"<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="roles must be"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_file(tiny_json, {"chat_template": "{{ messages.append(1) }}"}
                            ).apply_chat_template([])


class _FakeField:
    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


class _FakeReader:
    """Just the ``fields`` of a GGUFReader, for metadata-only tests."""

    def __init__(self, **fields: object) -> None:
        self.fields = {f"tokenizer.ggml.{k}": _FakeField(v) for k, v in fields.items()}


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata(_FakeReader(model="bert", tokens=["a", "b"]))


def test_byte_level_token_spelled_in_plain_text_is_respelled() -> None:
    from kvloom.tokenizer import _byte_spelling

    alphabet = [_byte_spelling()[b] for b in range(256)]
    # " a" should have been written "Ġa"; the merge is in byte-level spelling.
    reader = _FakeReader(model="gpt2", tokens=[*alphabet, " a"], merges=["Ġ a"],
                         token_type=[1] * 257)
    tokenizer = Tokenizer.from_gguf_metadata(reader)
    assert tokenizer.encode(" a") == [256]
    assert tokenizer.decode([256]) == " a"


def test_tiny_tokenizer_is_deterministic() -> None:
    assert json.loads(tiny_tokenizer_json())["model"]["vocab"] == json.loads(
        tiny_tokenizer_json.__wrapped__())["model"]["vocab"]


# ------------------------------------------------ SentencePiece-style GGUF vocab
_SPM_PIECES = ["\u2581", "e", "l", "o", "h", "w", "r", "d", "t", "a", "n", "s", "i", "\u2581h",
               "he", "ll", "llo", "\u2581he", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld",
               "\u2581world", "\u2581t", "th", "\u2581the", "an", "\u2581an", "in", "\u2581in",
               "st", "\u2581st", "好", "你", "\u2581你"]
SPM_TEXTS = ["hello world", " hello  world ", "the answer in the stand", "你好 hello",
             "xyz 😀", "hello\nworld", "", "hello</s> world", "<s>hello"]


def _write_spm_gguf(path: Path) -> Path:
    """A llama-style GGUF whose tokenizer is SentencePiece (scores, byte fallback)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


def test_sentencepiece_gguf_matches_transformers(spm_path: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_metadata(gguf_loader.open_gguf(spm_path))
    theirs = AutoTokenizer.from_pretrained(spm_path.parent, gguf_file=spm_path.name)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_incremental_keeps_word_spaces(spm_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf_metadata(gguf_loader.open_gguf(spm_path))
    prompt = tokenizer.encode("the")
    output = tokenizer.encode(" hello world 你好 😀", add_special_tokens=False)
    deltas = _stream(tokenizer, prompt, output)
    full = tokenizer.decode(prompt + output)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)):] == " hello world 你好 😀"
