"""Hugging Face model ids: resolved from a hub cache laid out as huggingface_hub lays it
(blobs, symlinked snapshots, refs, the cached file listing), offline, with revisions;
a missing id is one clear line and no network attempt."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import httpx2
import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.cli import main
from kvloom.models.errors import ModelLoadError
from kvloom.models.hub import ALLOW_PATTERNS, IGNORE_PATTERNS
from kvloom.models.loader import load_checkpoint
from tests.helpers_models import tiny_state_dict, write_hub_cache, write_tiny_hf_model

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two revisions with different weights: main (seed 0) and v2 (seed 1)."""
    root = tmp_path_factory.mktemp("sources")
    return {"main": write_tiny_hf_model(root / "main", "llama", seed=0),
            "v2": write_tiny_hf_model(root / "v2", "llama", seed=1)}


@pytest.fixture()
def network_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and refuse) every DNS lookup, socket connect and HTTP request."""
    attempts: list[str] = []

    def refuse(kind: str, error: type[Exception]):
        def fail(*args, **kwargs):
            attempts.append(f"{kind} {args[1:2]}")
            raise error(f"network is unreachable ({kind})")
        return fail

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo", socket.gaierror))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect", OSError))
    # What httpx raises when the network is down.
    monkeypatch.setattr(httpx2.Client, "send", refuse("http", httpx2.ConnectError))
    return attempts


@pytest.fixture()
def hub_cache(tmp_path: Path, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    cache = tmp_path / "hub"
    commits = write_hub_cache(cache, REPO, sources)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, commits


def _snapshot(cache: Path, commit: str) -> Path:
    return cache / "models--tiny-org--tiny-llama" / "snapshots" / commit


def _one_line_error(model: str, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(model, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_cache_layout_is_what_huggingface_hub_reads(hub_cache, network_attempts) -> None:
    """The fixture itself: huggingface_hub's own cache scanner sees two revisions of one
    repo, with their refs, made of symlinks into shared blobs."""
    from huggingface_hub import scan_cache_dir

    cache, commits = hub_cache
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {rev.commit_hash: set(rev.refs) for rev in repo.revisions} == {
        commits["main"]: {"main"}, commits["v2"]: {"v2"}}
    config = _snapshot(cache, commits["main"]) / "config.json"
    assert config.is_symlink() and config.resolve().parent.name == "blobs"
    # The tokenizer is the same bytes in both revisions: one blob.
    assert (_snapshot(cache, commits["v2"]) / "tokenizer.json").resolve() == (
        _snapshot(cache, commits["main"]) / "tokenizer.json").resolve()
    assert network_attempts == []


def test_load_by_id_reads_the_main_snapshot(hub_cache, sources, network_attempts) -> None:
    cache, commits = hub_cache
    checkpoint = load_checkpoint(REPO)
    assert checkpoint.name == REPO
    assert checkpoint.path == _snapshot(cache, commits["main"])
    expected = tiny_state_dict(sources["main"])
    weights = dict(checkpoint.weights())
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert network_attempts == []


@pytest.mark.parametrize("by", ["branch", "commit"])
def test_load_by_id_and_revision(hub_cache, sources, network_attempts, by: str) -> None:
    cache, commits = hub_cache
    revision = "v2" if by == "branch" else commits["v2"]
    checkpoint = load_checkpoint(REPO, revision=revision)
    assert checkpoint.path == _snapshot(cache, commits["v2"])
    expected = tiny_state_dict(sources["v2"])
    weights = dict(checkpoint.weights())
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    # v2's weights are not main's: the revision picked a different snapshot.
    main_embed = tiny_state_dict(sources["main"])["model.embed_tokens.weight"]
    assert not torch.equal(weights["model.embed_tokens.weight"], main_embed)
    assert network_attempts == []


def test_hf_home_locates_the_cache(tmp_path: Path, sources, monkeypatch, network_attempts) -> None:
    commits = write_hub_cache(tmp_path / "hf-home" / "hub", REPO, sources)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checkpoint = load_checkpoint(REPO)
    snapshots = tmp_path / "hf-home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots"
    assert checkpoint.path == snapshots / commits["main"]
    assert network_attempts == []


def test_cached_model_needs_no_offline_flag(hub_cache, network_attempts, monkeypatch) -> None:
    """With HF_HUB_OFFLINE unset, a cached model still loads without a network call."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    cache, commits = hub_cache
    assert load_checkpoint(REPO).path == _snapshot(cache, commits["main"])
    assert network_attempts == []


def test_missing_id_offline_is_one_clear_line(hub_cache, network_attempts) -> None:
    cache, _ = hub_cache
    message = _one_line_error("tiny-org/absent")
    assert f"not in the Hugging Face cache at {cache / 'models--tiny-org--absent'}" in message
    assert "`hf download tiny-org/absent`" in message and "HF_HUB_OFFLINE=0" in message
    assert network_attempts == []
    message = _one_line_error(REPO, revision="v3")
    assert "(revision v3)" in message and f"`hf download {REPO} --revision v3`" in message
    assert network_attempts == []


def test_missing_id_without_network_is_one_clear_line(hub_cache, network_attempts, monkeypatch) -> None:
    """Downloads allowed but the Hub unreachable: the same line, after huggingface_hub
    tried (and failed) to reach it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    cache, _ = hub_cache
    message = _one_line_error("tiny-org/absent")
    assert f"not in the Hugging Face cache at {cache / 'models--tiny-org--absent'}" in message
    assert "cannot be reached" in message and "`hf download tiny-org/absent`" in message
    assert network_attempts  # it did try


def test_partial_snapshot_offline_names_what_is_missing(tmp_path, sources, monkeypatch, network_attempts) -> None:
    """A snapshot holding only config.json (another tool fetched just that): not loadable,
    and the error says what is missing instead of a loader error about the snapshot."""
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(sources["main"] / "config.json", partial)
    for listing in (False, True):
        cache = tmp_path / f"hub-{listing}"
        write_hub_cache(cache, REPO, {"main": partial}, tree_listing=listing)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        message = _one_line_error(REPO)
        assert "not in the Hugging Face cache" in message
        assert "missing tokenizer.json, *.safetensors weights" in message
    assert network_attempts == []


def test_cached_pickle_only_snapshot_is_refused(tmp_path, sources, monkeypatch, network_attempts) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(sources["main"] / name, pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    write_hub_cache(tmp_path / "hub", REPO, {"main": pickled})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("pickle.load", lambda *a, **k: pytest.fail("unpickled"))
    message = _one_line_error(REPO)
    assert "refusing pickle weights (pytorch_model.bin)" in message and "convert to safetensors" in message


def test_local_path_wins_over_an_id(hub_cache, sources, tmp_path, monkeypatch) -> None:
    local = tmp_path / "cwd" / "tiny-org" / "tiny-llama"
    shutil.copytree(sources["v2"], local)
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_checkpoint(REPO).path == Path(REPO)
    assert "revision='v2'" in _one_line_error(REPO, revision="v2")  # a path has no revisions
    assert "model path does not exist" in _one_line_error(str(tmp_path / "nowhere"))


def test_llm_by_id_generates_what_the_snapshot_path_generates(hub_cache, sources, network_attempts) -> None:
    cache, commits = hub_cache
    prompts = ["The quick brown fox", "Paged attention"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(model: str, **kwargs) -> list[list[int]]:
        llm = LLM(model, dtype="float32", num_blocks=32, **kwargs)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]

    by_id = tokens(REPO)
    assert by_id == tokens(str(_snapshot(cache, commits["main"])))
    by_revision = tokens(REPO, revision="v2")
    assert by_revision == tokens(str(sources["v2"]))
    assert by_revision != by_id
    assert all(len(ids) == 8 for ids in by_id + by_revision)
    assert network_attempts == []


def test_cli_revision_flag_and_missing_id(hub_cache, sources, capsys, network_attempts) -> None:
    argv = ["--prompt", "Hello", "--max-tokens", "4", "--dtype", "float32", "--num-blocks", "16", "--temperature", "0"]
    assert main(["generate", REPO, "--revision", "v2", *argv]) == 0
    by_id = capsys.readouterr().out
    assert main(["generate", str(sources["v2"]), *argv]) == 0
    assert capsys.readouterr().out == by_id
    assert main(["generate", "tiny-org/absent", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the Hugging Face cache" in err[0]
    assert network_attempts == []


def test_download_fetches_only_what_the_loader_reads(tmp_path, sources, monkeypatch, network_attempts) -> None:
    """With downloads allowed and the id not cached, huggingface_hub's snapshot_download
    is asked for config, tokenizer and safetensors only (the patterns go through its own
    filter here; the network is faked by laying the filtered files into the cache)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    remote = tmp_path / "remote"
    shutil.copytree(sources["main"], remote)
    (remote / "pytorch_model.bin").write_bytes(b"pickle")
    (remote / "consolidated.safetensors").write_bytes(b"a second copy")
    (remote / "README.md").write_text("# tiny")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    real = huggingface_hub.snapshot_download
    downloads: list[list[str]] = []

    def fake_snapshot_download(repo_id, **kwargs):
        if not kwargs.get("local_files_only"):
            assert repo_id == REPO and Path(kwargs["cache_dir"]) == cache
            names = sorted(filter_repo_objects(
                [p.name for p in remote.iterdir()] + ["onnx/model.safetensors"],
                allow_patterns=kwargs["allow_patterns"], ignore_patterns=kwargs["ignore_patterns"]))
            downloads.append(names)
            fetched = tmp_path / "fetched"
            fetched.mkdir()
            for name in names:
                shutil.copy(remote / name, fetched / name)
            write_hub_cache(cache, repo_id, {"main": fetched})
        return real(repo_id, **{**kwargs, "local_files_only": True})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    checkpoint = load_checkpoint(REPO)
    assert downloads == [["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"]]
    expected = tiny_state_dict(sources["main"])
    assert all(torch.equal(t, expected[name]) for name, t in checkpoint.weights())
    # Cached now: the next load is offline, with no download.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_checkpoint(REPO).path == checkpoint.path
    assert len(downloads) == 1 and network_attempts == []


def test_download_of_a_pickle_only_repo_is_refused(tmp_path, sources, monkeypatch) -> None:
    """The repo's listing (cached by huggingface_hub with the download) shows pickle
    weights only: the loader's pickle message, not "no weights in <snapshot>"."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    real = huggingface_hub.snapshot_download
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(sources["main"] / name, fetched)

    def fake_snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        write_hub_cache(cache, repo_id, {"main": fetched})
        # The listing names the file that was not downloaded (it matched no pattern).
        storage = cache / ("models--" + repo_id.replace("/", "--"))
        listing_file = next((storage / "trees").iterdir())
        listing = listing_file.read_text().replace('"files": {', '"files": {"pytorch_model.bin": '
                                                   '{"size": 6, "blob_id": "0"}, ', 1)
        listing_file.write_text(listing)
        return real(repo_id, **{**kwargs, "local_files_only": True})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    message = _one_line_error(REPO)
    assert message == f"refusing pickle weights (pytorch_model.bin) in {REPO}: convert to safetensors"


def test_patterns_cover_the_loaders_files() -> None:
    """Every file the HF-directory loader reads matches ALLOW_PATTERNS (and no ignore
    pattern); pickles and subfolders match none."""
    from huggingface_hub.utils import filter_repo_objects

    wanted = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "model.pt", "consolidated.safetensors", "original/model.safetensors",
                "README.md", "model.gguf", "flax_model.msgpack"]
    kept = list(filter_repo_objects(wanted + unwanted, allow_patterns=list(ALLOW_PATTERNS),
                                    ignore_patterns=list(IGNORE_PATTERNS)))
    assert kept == wanted


def test_bad_revision_value_names_the_field() -> None:
    from kvloom.config import EngineConfig

    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match="^revision must be a non-empty string"):
            EngineConfig.from_kwargs(REPO, revision=bad)
