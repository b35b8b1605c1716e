"""A sentence-transformers model's pooling, as vLLM reads it: ``modules.json`` names a
Pooling module (its ``config.json`` says which tokens pool: the mean, the first, the
last) and maybe a Normalize module (no Normalize: embeddings are not normalized). The
engine puts what it finds in config.json's ``pooler_config`` (``PoolerConfig``), under
``--pooler-config``'s keys, which win."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# Pooling config.json's switches -> vLLM's pooling types.
_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST",
          "cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


def sentence_transformers_pooler(model_dir: Path) -> dict[str, Any] | None:
    """The pooler config a sentence-transformers directory asks for (vLLM's keys), or
    None for a model that is no such directory. A pooling mode kvloom does not compute
    (max, weighted mean, mean over sqrt(length)) is refused by name: pooling it another
    way would answer different embeddings than the model's own."""
    modules_file = model_dir / "modules.json"
    if not model_dir.is_dir() or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must be a list of modules")
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _POOLING_MODULE), None)
    normalize = any(isinstance(m, dict) and m.get("type") == _NORMALIZE_MODULE for m in modules)
    config: dict[str, Any] = {"use_activation": normalize}
    if pooling is None:
        return config
    pooling_file = model_dir / str(pooling.get("path", "")) / "config.json"
    settings = json.loads(pooling_file.read_text(encoding="utf-8")) if pooling_file.is_file() else {}
    chosen = [settings["pooling_mode"]] if isinstance(settings.get("pooling_mode"), str) else \
        [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
    if not chosen:
        return config
    kinds = {_MODES.get(mode) for mode in chosen}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"{pooling_file}: pooling {', '.join(sorted(chosen))} is not supported (kvloom pools by "
                         "the mean, the first or the last token, one of them): give --pooler-config to choose")
    config["seq_pooling_type"] = kinds.pop()
    return config


def with_pooler_config(hf: dict[str, Any], model_dir: Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf`` with its ``pooler_config``: the sentence-transformers directory's, with
    ``overrides`` (``--pooler-config``) key by key over it; ``hf`` itself where neither
    says anything."""
    found = sentence_transformers_pooler(model_dir)
    if found is None and not overrides:
        return hf
    merged = {**(found or {}), **(overrides or {})}
    if "pooling_type" in merged and "seq_pooling_type" in (found or {}) and "seq_pooling_type" not in (overrides or {}):
        del merged["seq_pooling_type"]  # the flag's pooling_type replaces the directory's choice
    return {**hf, "pooler_config": merged}
