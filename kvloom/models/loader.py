"""Checkpoint loading: a Hugging Face directory, a GGUF file, or the default model.

``load_checkpoint`` validates everything it can up front (paths, headers, file
sizes, tokenizer) so a bad model fails with one clear ``ModelLoadError`` line before
any memory is committed; tensors are then yielded lazily by ``Checkpoint.weights``.
Pickle checkpoints (``.bin``/``.pt``) are refused, never unpickled: loading one can
run arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvloom.models.errors import ModelLoadError
from kvloom.models.sharding import TensorSlice
from kvloom.paths import kvloom_home
from kvloom.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Dequantized GGUF checkpoints up to this size (float32 bytes) are cached as
# safetensors: parsing a GGUF header and dequantizing take seconds, an mmap doesn't.
_GGUF_CACHE_MAX_BYTES = 4 << 30
# Bump when the GGUF conversion changes, so stale caches are rebuilt.
_GGUF_CACHE_VERSION = 2  # 2: llama-family Q/K biases un-permuted; the new families


# HF parameter name -> the part of that tensor to read (None: all of it).
SliceOf = Callable[[str], TensorSlice | None]


@dataclass
class Checkpoint:
    """A model's HF-style config, tokenizer and (lazily read) parameters."""

    name: str
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    path: Path
    weight_source: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # Reads only the asked-for part of each tensor (safetensors' slices: a tensor-parallel
    # rank reads its shard, not the whole checkpoint); None where the source cannot.
    sliced_source: Callable[[SliceOf], Iterator[tuple[str, torch.Tensor]]] | None = field(
        default=None, repr=False)

    def weights(self, slice_of: SliceOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(HF parameter name, tensor)`` one at a time; ``lm_head.weight``
        is absent when embeddings are tied. Each call starts a fresh pass. With
        ``slice_of``, each tensor is cut to ``slice_of(name)``: read as that slice from
        safetensors, cut after reading from other sources (a GGUF too large to cache)."""
        if slice_of is None:
            return self.weight_source()
        if self.sliced_source is not None:
            return self.sliced_source(slice_of)
        return _cut(self.weight_source(), slice_of)


def load_checkpoint(model: str, home: str | Path | None = None,
                    cache_gguf: bool = True, revision: str | None = None) -> Checkpoint:
    """Load ``model``: a HF directory, a ``.gguf`` file, ``DEFAULT_MODEL`` (downloaded
    once into ``home``, default ``$KVLOOM_HOME`` or ``~/.cache/kvloom``), or a Hugging
    Face model id ``ORG/NAME`` at ``revision`` (from the Hugging Face cache, downloaded
    there when missing: kvloom/models/hub.py). A local path that exists wins over an id."""
    from kvloom.config import DEFAULT_MODEL
    from kvloom.models import hub

    path = Path(model).expanduser()
    if model == DEFAULT_MODEL:
        from kvloom.models.default_model import resolve_default_model

        _refuse_revision(model, revision)
        path = resolve_default_model(home)
    elif not path.exists() and hub.is_hub_id(model):
        path = hub.resolve_hub_model(model, revision)
    else:
        _refuse_revision(model, revision)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if path.is_dir():
        return _load_hf_dir(path, model)
    if path.suffix == ".gguf":
        return _load_gguf(path, model, home, cache_gguf)
    if path.suffix in _PICKLE_SUFFIXES:
        raise ModelLoadError(f"refusing pickle weights {path}: convert to safetensors")
    raise ModelLoadError(f"unsupported model file {path}: expected a Hugging Face "
                         "model directory or a .gguf file")


def load_tokenizer(path: Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """The tokenizer of a Hugging Face directory: ``tokenizer.json`` with its
    ``tokenizer_config.json`` and ``chat_template.jinja``, if any; ``extra_eos_token_ids``
    (the model's config's) stop generation too."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"missing tokenizer: {path} has no tokenizer.json")
    tokenizer_config = _read_json(path / "tokenizer_config.json", default={})
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        tokenizer_config["chat_template"] = template_file.read_text(encoding="utf-8")
    try:
        return Tokenizer.from_file(tokenizer_file, tokenizer_config, extra_eos_token_ids=extra_eos_token_ids)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ModelLoadError(f"cannot load tokenizer {tokenizer_file}: {exc}") from None


def replacement_tokenizer(path: Path, checkpoint: Checkpoint) -> Tokenizer:
    """``path``'s tokenizer for ``checkpoint``'s model (vLLM's ``--tokenizer``), stopping
    on the model's end-of-sequence ids as well as its own; ModelLoadError where its ids
    run past the model's vocabulary (they would index no embedding row). The checkpoint's
    config takes its stop and BOS ids, as from the model's own tokenizer."""
    hf_config = checkpoint.hf_config
    tokenizer = load_tokenizer(path, _as_id_list(hf_config.get("eos_token_id")))
    size, vocab = tokenizer.backend.get_vocab_size(with_added_tokens=True), int(hf_config["vocab_size"])
    if size > vocab:
        raise ModelLoadError(f"tokenizer {path} has {size} token ids, more than the model's vocabulary of {vocab}: "
                             f"it is not this model's tokenizer")
    hf_config["eos_token_id"] = list(tokenizer.eos_token_ids)
    if tokenizer.bos_token_id is not None:
        hf_config["bos_token_id"] = tokenizer.bos_token_id
    return tokenizer


def _refuse_revision(model: str, revision: str | None) -> None:
    if revision is not None:
        raise ModelLoadError(f"revision={revision!r} names a revision of a Hugging Face model id "
                             f"(ORG/NAME), but {model!r} is not one")


# ------------------------------------------------------------------ HF directory
def _load_hf_dir(path: Path, name: str) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    hf_config = _read_json(config_file)
    shards = _safetensors_shards(path)
    for shard in shards:
        _check_safetensors(shard)
    generation_config = _read_json(path / "generation_config.json", default={})
    eos_ids = _as_id_list(hf_config.get("eos_token_id")) + _as_id_list(
        generation_config.get("eos_token_id"))
    tokenizer = load_tokenizer(path, eos_ids)
    # One source of truth for stop ids: config, generation config and chat template.
    hf_config["eos_token_id"] = list(tokenizer.eos_token_ids)
    if hf_config.get("bos_token_id") is None and tokenizer.bos_token_id is not None:
        hf_config["bos_token_id"] = tokenizer.bos_token_id

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        return sliced_weights(lambda _: None)

    def sliced_weights(slice_of: SliceOf) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(shard), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    part = slice_of(key)
                    if part is None:
                        yield key, handle.get_tensor(key)
                        continue
                    tensor = handle.get_slice(key)
                    index = [slice(None)] * len(tensor.get_shape())
                    index[part.dim] = slice(part.start, part.end)
                    yield key, tensor[tuple(index)]

    return Checkpoint(name, hf_config, tokenizer, path, weights, sliced_weights)


def _cut(weights: Iterator[tuple[str, torch.Tensor]], slice_of: SliceOf) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        part = slice_of(name)
        yield name, (tensor if part is None
                     else tensor.narrow(part.dim, part.start, part.end - part.start).contiguous())


def _safetensors_shards(path: Path) -> list[Path]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map") or {}
        shards = [path / shard for shard in dict.fromkeys(weight_map.values())]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} listed in {index_file.name} is missing")
        if shards:
            return shards
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    # consolidated.safetensors is Mistral's own format (other names): not ours.
    others = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if others:
        return others
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(f"refusing pickle weights ({pickles[0]}) in {path}: convert to "
                             "safetensors")
    raise ModelLoadError(f"no *.safetensors weights in {path}")


def _check_safetensors(shard: Path) -> None:
    """Header parses and the file holds every byte the header promises: a truncated
    download fails here, not halfway through loading weights."""
    size = shard.stat().st_size
    try:
        with shard.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(handle.read(header_len))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ModelLoadError(f"corrupt safetensors file {shard}: {exc}") from None
    if 8 + header_len + max(ends, default=0) > size:
        raise ModelLoadError(f"truncated safetensors file {shard}: {size} bytes, header "
                             f"needs {8 + header_len + max(ends)}")


# ------------------------------------------------------------------------ GGUF
def _load_gguf(path: Path, name: str, home: str | Path | None, cache: bool) -> Checkpoint:
    from kvloom.models import gguf_loader

    cache_dir = _gguf_cache_dir(path, home) if cache else None
    if cache_dir is not None and _gguf_cache_valid(cache_dir, path):
        checkpoint = _load_hf_dir(cache_dir, name)
        checkpoint.path = path
        return checkpoint
    reader = gguf_loader.open_gguf(path)
    arch = gguf_loader.gguf_architecture(reader, path)
    hf_config = gguf_loader.gguf_hf_config(reader, path)
    tokenizer = gguf_loader.gguf_tokenizer(reader, path)
    hf_config["bos_token_id"] = tokenizer.bos_token_id
    hf_config["eos_token_id"] = list(tokenizer.eos_token_ids)
    weights = gguf_loader.gguf_weights(reader, arch, hf_config)
    num_elements = sum(int(t.n_elements) for t in reader.tensors)
    if cache_dir is not None and num_elements * 4 <= _GGUF_CACHE_MAX_BYTES:
        try:
            _write_gguf_cache(cache_dir, path, hf_config, tokenizer, weights,
                              num_tensors=gguf_loader.num_weights(reader))
            checkpoint = _load_hf_dir(cache_dir, name)
            checkpoint.path = path
            return checkpoint
        except OSError as exc:  # read-only or full disk: caching is an optimisation
            logger.warning("could not cache dequantized %s: %s", path, exc)
    return Checkpoint(name, hf_config, tokenizer, path, weights)


def _gguf_cache_dir(path: Path, home: str | Path | None) -> Path:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    return kvloom_home(home) / "gguf-cache" / f"{path.stem}-{digest}"


def _gguf_source_stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "version": _GGUF_CACHE_VERSION}


def _gguf_cache_valid(cache_dir: Path, path: Path) -> bool:
    stamp = _read_json(cache_dir / "source.json", default=None, strict=False)
    return stamp == _gguf_source_stamp(path)


def _write_gguf_cache(cache_dir: Path, path: Path, hf_config: dict[str, Any],
                      tokenizer: Tokenizer,
                      weights: Callable[[], Iterator[tuple[str, torch.Tensor]]], num_tensors: int) -> None:
    """Write the GGUF as a HF directory: build it beside the target, then rename,
    so a crash never leaves a half-written cache that looks valid. Once per file; a
    progress bar shows the dequantization (a minute for the default model on 2 cores)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(cache_dir)
    staging = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        logger.info("dequantizing %s once into %s", path.name, cache_dir)
        with tqdm(weights(), total=num_tensors, desc=f"dequantizing {path.name}", unit="tensor",
                  disable=None) as tensors:  # None: no bar where stderr is not a terminal
            save_file(dict(tensors), str(staging / "model.safetensors"))
        (staging / "config.json").write_text(json.dumps(hf_config, indent=1))
        tokenizer.save(staging)
        # Written last: its presence with a matching stamp marks the cache complete.
        (staging / "source.json").write_text(json.dumps(_gguf_source_stamp(path)))
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(staging, cache_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(cache_dir: Path) -> None:
    """Delete staging directories left by writers that died (kill -9 mid-write); a
    live writer's (its pid still running) is left alone."""
    for staging in cache_dir.parent.glob(f"{cache_dir.name}.tmp-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


# --------------------------------------------------------------------- helpers
def _read_json(path: Path, default: Any = ..., strict: bool = True) -> Any:
    if not path.is_file():
        if default is ...:
            raise ModelLoadError(f"missing file: {path}")
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        if not strict:
            return default
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []
