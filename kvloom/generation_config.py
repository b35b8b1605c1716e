"""``--generation-config``: sampling defaults from a model's ``generation_config.json``,
as vLLM reads them. They apply to the fields a request leaves unset.

``auto`` reads the model directory's file, if it has one (a ``.gguf`` file has none);
``vllm`` and ``none`` ignore it; any other value is a directory whose
``generation_config.json`` is read (it must exist). Only the sampling keys are taken,
and only those the file sets: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). Like vLLM, the
values are taken whether or not the file sets ``do_sample``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def generation_defaults(setting: str, model_path: str | Path | None,
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults ``setting`` asks for (``model_path``: the loaded model's
    directory or file), with ``override``'s keys (``--override-generation-config``,
    checked by ``parse_override``) over them; ``{}`` when there are none."""
    over = {SAMPLING_KEYS[key]: value for key, value in (override or {}).items()}
    return {**_file_defaults(setting, model_path), **over}


def json_object(value: Any, name: str) -> dict[str, Any]:
    """An option given as a dict (an ``LLM`` keyword) or as its JSON text (the flag):
    the dict; ValueError naming ``name`` unless it is a JSON object. (Here, below
    config.py, which parses its JSON options with it too.)"""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def parse_override(value: Any) -> dict[str, Any]:
    """``--override-generation-config`` (vLLM's): JSON text or a dict of
    generation_config.json's sampling keys, each value checked as SamplingParams checks
    it. A key that is not a sampling default is refused, naming it (vLLM would ignore it)."""
    from kvloom.sampling_params import SamplingParams

    value = json_object(value, "override_generation_config")
    unknown = sorted(set(value) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config has keys {unknown} that are not sampling defaults; "
                         f"known: {list(SAMPLING_KEYS)}")
    try:
        SamplingParams(**{SAMPLING_KEYS[key]: item for key, item in value.items()})
    except (TypeError, ValueError) as error:
        raise ValueError(f"override_generation_config: {error}") from None
    return dict(value)


def _file_defaults(setting: str, model_path: str | Path | None) -> dict[str, Any]:
    if setting in ("vllm", "none"):
        return {}
    if setting == "auto":
        if model_path is None or not Path(model_path).is_dir():
            return {}
        file = Path(model_path) / FILE_NAME
        return _read(file) if file.is_file() else {}
    file = Path(setting).expanduser() / FILE_NAME
    if not file.is_file():
        raise ValueError(f"generation_config: no {FILE_NAME} in {setting!r} (expected 'auto', "
                         "'vllm', 'none' or a directory holding one)")
    return _read(file)


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"generation_config: cannot read {file}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {file} must hold a JSON object")
    return {field: data[key] for key, field in SAMPLING_KEYS.items() if data.get(key) is not None}
