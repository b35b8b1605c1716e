"""Hugging Face model ids (``ORG/NAME``): resolved to a snapshot directory of the local
Hugging Face cache through ``huggingface_hub``, downloaded there when missing.

The cache is read first and, when it holds what the loader needs, nothing touches the
network (so a cached model works offline, with or without ``HF_HUB_OFFLINE``). Only
the files the loader reads are fetched: config, safetensors weights and tokenizer
files (``ALLOW_PATTERNS``); pickle weights never are. The cache directory and offline
mode are read from the environment at each call (``HF_HUB_CACHE``, ``HF_HOME``,
``HF_HUB_OFFLINE``), not frozen when ``huggingface_hub`` was first imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvloom.models.errors import ModelLoadError

# What the HF-directory loader reads (kvloom/models/loader.py `_load_hf_dir`).
ALLOW_PATTERNS = ("config.json", "generation_config.json", "*.safetensors",
                  "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja")
# Subfolders (onnx/, original/, ...) and Mistral's consolidated.safetensors (a second copy
# of the weights in another format) are never read.
IGNORE_PATTERNS = ("*/*", "consolidated*")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# "namespace/name" as the Hub spells it (huggingface_hub's validate_repo_id has the rest).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hub model id ``ORG/NAME`` (the caller has already
    checked that no local path of that name exists: a local path always wins)."""
    if not _REPO_ID.fullmatch(model) or "--" in model or ".." in model:
        return False
    return not model.endswith((".git", ".gguf"))


def hub_cache_dir() -> Path:
    """The hub cache as ``huggingface_hub`` would pick it from the environment now:
    ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit
    hash; default the repo's main branch): from the cache when it holds the model
    (no network call), else downloaded into the cache with huggingface_hub's progress
    bar. Every failure is one ``ModelLoadError`` line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    options: dict[str, Any] = dict(revision=revision, cache_dir=cache,
                                   allow_patterns=list(ALLOW_PATTERNS),
                                   ignore_patterns=list(IGNORE_PATTERNS))
    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True, **options))
        missing = _missing_files(snapshot)
    except HFValidationError as exc:
        raise ModelLoadError(f"invalid Hugging Face model id {repo_id!r}: {exc}") from None
    except IncompleteSnapshotError as exc:  # the cached file listing says files are missing
        missing = _missing_files(Path(exc.snapshot_path)) or ["files of the repo's listing"]
    except LocalEntryNotFoundError:
        missing = ["the snapshot"]
    if not missing:
        return snapshot
    if hub_offline():
        raise ModelLoadError(_not_cached(repo_id, revision, cache, missing, "HF_HUB_OFFLINE is set"))
    try:
        snapshot = Path(snapshot_download(repo_id, **options))
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id} is gated on the Hugging Face Hub: accept its terms on "
                             "huggingface.co and log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id} is not a model on the Hugging Face Hub (or it is private: "
                             "log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except (LocalEntryNotFoundError, IncompleteSnapshotError):
        raise ModelLoadError(_not_cached(repo_id, revision, cache, missing,
                                         "the Hugging Face Hub cannot be reached")) from None
    except (HfHubHTTPError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot download {repo_id} from the Hugging Face Hub: {reason}") from None
    _refuse_unloadable(repo_id, revision, cache, snapshot)
    return snapshot


def _missing_files(snapshot: Path) -> list[str]:
    """What the loader needs that ``snapshot`` lacks (a partial cache, e.g. after a
    tool fetched only config.json): config, tokenizer, and weights (pickle weights
    count: the loader refuses them with its own message)."""
    if not snapshot.is_dir():
        return ["the snapshot"]
    missing = [name for name in ("config.json", "tokenizer.json") if not (snapshot / name).is_file()]
    weights = [p for p in snapshot.iterdir() if p.suffix == ".safetensors" or p.suffix in _PICKLE_SUFFIXES]
    index = snapshot / "model.safetensors.index.json"
    if not weights or (index.is_file() and not _index_shards_present(index)):
        missing.append("*.safetensors weights")
    return missing


def _index_shards_present(index: Path) -> bool:
    import json

    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    except (ValueError, OSError):
        return True  # the loader reports the unreadable index
    return all((index.parent / shard).is_file() for shard in set(weight_map.values()))


def _not_cached(repo_id: str, revision: str | None, cache: Path, missing: list[str], why: str) -> str:
    from huggingface_hub.file_download import repo_folder_name

    at = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    what = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    partial = "" if missing == ["the snapshot"] else f" (missing {', '.join(missing)})"
    flag = f" --revision {revision}" if revision else ""
    return (f"{what} is not a local path and not in the Hugging Face cache at {at}{partial}, and {why}: "
            f"fetch it with `hf download {repo_id}{flag}`, or set HF_HUB_OFFLINE=0 with network")


def _refuse_unloadable(repo_id: str, revision: str | None, cache: Path, snapshot: Path) -> None:
    """After a download: a repo with no safetensors weights gets the reason (pickle-only
    or GGUF-only, from the repo's file listing that huggingface_hub cached), not the
    loader's "no weights in <snapshot>"."""
    if not _missing_files(snapshot):
        return
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        names = [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache)]
    except CachedRepoTreeNotFoundError:
        return
    top = [name for name in names if "/" not in name]
    pickles = sorted(name for name in top if name.endswith(_PICKLE_SUFFIXES))
    ggufs = sorted(name for name in names if name.endswith(".gguf"))
    if not any(name.endswith(".safetensors") for name in top):
        if pickles:
            raise ModelLoadError(f"refusing pickle weights ({pickles[0]}) in {repo_id}: convert to "
                                 "safetensors")
        if ggufs:
            raise ModelLoadError(f"{repo_id} has no safetensors weights, only GGUF files: fetch one with "
                                 f"`hf download {repo_id} {ggufs[0]}` and pass its path")
