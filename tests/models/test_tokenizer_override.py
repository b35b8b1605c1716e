"""--tokenizer (vLLM's): a .gguf model served with a Hugging Face directory's tokenizer
instead of the one its metadata describes. The replacement's ids, special tokens and
chat template are that directory's, held to Hugging Face ``tokenizers`` reading the same
files; the generated tokens are the model's whatever tokenizer names them; a tokenizer
whose ids outrun the model's vocabulary, or no tokenizer at the path, is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_models import write_tiny_gguf, write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.models.errors import ModelLoadError

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny model as a .gguf, a tokenizer directory of the same vocabulary with two
    padding tokens renamed <think> and </think> and a template of its own)."""
    root = tmp_path_factory.mktemp("override")
    hf_dir = write_tiny_hf_model(root / "hf", arch="llama")
    gguf_file = write_tiny_gguf(hf_dir, root / "tiny.gguf")
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (hf_dir / name).read_text().replace("<|extra_0|>", "<think>").replace("<|extra_1|>", "</think>")
        (tokenizer_dir / name).write_text(text)
    (tokenizer_dir / "chat_template.jinja").write_text(TEMPLATE)
    return gguf_file, tokenizer_dir


def test_the_directorys_tokenizer_names_the_models_tokens(model: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer
    gguf_file, tokenizer_dir = model
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    plain = LLM(str(gguf_file), dtype="float32", num_blocks=32)
    assert plain.get_tokenizer().token_to_id("<think>") is None  # the GGUF's own vocabulary
    llm = LLM(str(gguf_file), dtype="float32", num_blocks=32, tokenizer=str(tokenizer_dir))
    tokenizer = llm.get_tokenizer()
    for text in ("Hello <think>fox</think> world", "The quick brown fox", "café 😀"):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.chat_template == TEMPLATE
    assert llm.encode_chat([{"role": "user", "content": "hi"}]) == reference.encode("<user>hi<a>").ids
    # The model is the same: the same greedy tokens from the same prompt ids.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = reference.encode("The quick brown fox").ids
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain.generate([prompt], params)[0].outputs[
        0].token_ids


def test_a_tokenizer_that_is_not_the_models_is_refused(model: tuple[Path, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    gguf_file, tokenizer_dir = model
    bigger = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bigger.add_tokens(["<a-token-past-the-vocabulary>"])
    shutil.copytree(tokenizer_dir, tmp_path / "bigger")
    bigger.save(str(tmp_path / "bigger" / "tokenizer.json"))
    assert json.loads((tmp_path / "bigger" / "tokenizer.json").read_text())["added_tokens"]
    with pytest.raises(ModelLoadError, match="has 513 token ids, more than the model's vocabulary of 512"):
        LLM(str(gguf_file), dtype="float32", num_blocks=32, tokenizer=str(tmp_path / "bigger"))
    with pytest.raises(ModelLoadError, match="missing tokenizer: .*nowhere has no tokenizer.json"):
        LLM(str(gguf_file), dtype="float32", num_blocks=32, tokenizer=str(tmp_path / "nowhere"))
