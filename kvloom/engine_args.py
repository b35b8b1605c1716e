"""The engine flags of every command (``serve``, ``generate``, ``chat``, ``bench ...``),
generated from the config dataclasses: one flag per ``ENGINE_OPTIONS`` entry.

A field ``block_size`` becomes ``--block-size`` with the field's type, default and
``help`` (and ``choices``) from its metadata; a bool that defaults to True becomes the
switch its ``flag`` metadata spells (``--no-prefix-cache``), one that defaults to False
a plain switch (``--trace``); ``model`` is the optional positional argument. The
parsed values come back as ``LLM(...)`` keywords through ``engine_kwargs``.

This module sits below every CLI module (it imports only the config), so the CLIs
import it and not each other.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any

from kvloom.config import ENGINE_OPTIONS, EngineOption

# CLI-only: not a config field, but it implies --trace.
TRACE_FILE_HELP = "write the scheduler's decision record here at exit (implies --trace)"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``[MODEL]`` and one flag per engine option (plus ``--trace-file``)."""
    group = parser.add_argument_group("engine")
    for option in ENGINE_OPTIONS:
        flag, spec = engine_flag(option)
        group.add_argument(flag, **spec)
    group.add_argument("--trace-file", default=None, help=TRACE_FILE_HELP)


def engine_flag(option: EngineOption) -> tuple[str, dict[str, Any]]:
    """The flag of one option and its ``add_argument`` keywords."""
    metadata = option.field.metadata
    if not metadata.get("help"):
        raise TypeError(f"engine option {option.name!r} needs metadata={{'help': ...}} on its field")
    spec: dict[str, Any] = {"default": option.default, "help": metadata["help"]}
    flag = metadata.get("flag", "--" + option.name.replace("_", "-"))
    if not flag.startswith("-"):  # the positional argument (the model)
        return flag, {**spec, "nargs": "?"}
    spec["dest"] = option.name
    if option.default is not None and option.type is not bool:
        spec["help"] += " (default: %(default)s)"
    if option.type is bool:
        if option.default and flag == "--" + option.name.replace("_", "-"):
            raise TypeError(f"engine option {option.name!r} defaults to True: give it a 'flag' "
                            "such as '--no-...' in its metadata")
        return flag, {**spec, "action": "store_false" if option.default else "store_true"}
    spec["type"] = _scalar_type(option)
    if "choices" in metadata:
        spec["choices"] = list(metadata["choices"])
    return flag, spec


def _scalar_type(option: EngineOption) -> type:
    """``int`` for ``int`` and ``int | None``; an unset optional flag keeps its None default."""
    kind = option.type
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kinds = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind not in (int, float, str):
        raise TypeError(f"engine option {option.name!r} has type {option.type!r}; flags take "
                        "int, float, str or bool (optionally | None)")
    return kind


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options parsed by ``add_engine_args``, as ``LLM(model, **kwargs)`` /
    ``EngineConfig.from_kwargs(model, **kwargs)`` keywords (the model is positional)."""
    kwargs = {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS
              if option.name != "model" and hasattr(args, option.name)}
    if getattr(args, "trace_file", None):
        kwargs["trace"] = True
    return kwargs


def save_trace(engine: Any, args: argparse.Namespace) -> None:
    """Write the scheduler's decision record where --trace-file asks."""
    if getattr(args, "trace_file", None):
        engine.scheduler.trace.save(args.trace_file)
        print(f"trace written to {args.trace_file}", file=sys.stderr)
