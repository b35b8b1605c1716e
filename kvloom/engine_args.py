"""The engine flags of every command (``serve``, ``generate``, ``chat``, ``bench ...``),
generated from the config dataclasses: one flag per ``ENGINE_OPTIONS`` entry.

A field ``block_size`` becomes ``--block-size`` with the field's type, default and
``help`` from its metadata, and from the optional metadata: ``choices`` (argparse
refuses anything else, before any model loads), ``parse`` (a checking function that
raises ValueError), ``flag`` (another spelling), ``aliases`` (further spellings of the
same flag). A bool is a switch ``--name`` plus the spellings in ``negatives`` that turn
it off (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``, and the older
``--no-prefix-cache``); one that defaults to True must have a negative. ``model`` is the
optional positional argument, also accepted as ``--model``. The parsed values come back
as ``LLM(...)`` keywords through ``engine_kwargs``.

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
        flags, spec = engine_flag(option)
        if not flags[0].startswith("-"):
            # The positional model: ``--model`` first, so that its default is the
            # namespace's; the positional (default None) sets the model only when given.
            group.add_argument(*flags[1:], **{**spec, "dest": option.name, "action": _ModelArgument})
            group.add_argument(flags[0], **{**spec, "default": None, "nargs": "?",
                                            "action": _ModelArgument, "metavar": flags[0].upper()})
        else:
            group.add_argument(*flags, **spec)
    group.add_argument("--trace-file", default=None, help=TRACE_FILE_HELP)


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: print kvloom's version and exit (before anything loads)."""
    from kvloom import __version__
    parser.add_argument("--version", action="version", version=f"kvloom {__version__}",
                        help="print kvloom's version and exit")


def engine_flag(option: EngineOption) -> tuple[list[str], dict[str, Any]]:
    """The spellings of one option's flag (the primary first) and its ``add_argument``
    keywords."""
    metadata = option.field.metadata
    if not metadata.get("help"):
        raise TypeError(f"engine option {option.name!r} needs metadata={{'help': ...}} on its field")
    spec: dict[str, Any] = {"default": option.default, "help": metadata["help"]}
    flags = [metadata.get("flag", "--" + option.name.replace("_", "-")), *metadata.get("aliases", ())]
    if not flags[0].startswith("-"):  # the positional argument (the model)
        return flags, spec
    spec["dest"] = option.name
    if option.default is not None and option.type is not bool:
        spec["help"] += " (default: %(default)s)"
    if option.type is bool:
        negatives = list(metadata.get("negatives", ()))
        if option.default and not negatives:
            raise TypeError(f"engine option {option.name!r} defaults to True: give it "
                            "'negatives' such as ('--no-...',) in its metadata")
        return flags + negatives, {**spec, "action": _Switch, "negatives": negatives}
    kind = _scalar_type(option)
    spec["type"] = _checked(metadata["parse"], kind) if "parse" in metadata else kind
    if "choices" in metadata:
        spec["choices"] = list(metadata["choices"])
    return flags, spec


class _Switch(argparse.Action):
    """A bool flag: its ``negatives`` spellings set False, every other spelling True."""

    def __init__(self, option_strings: list[str], dest: str, negatives: list[str],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.negatives = negatives

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


class _ModelArgument(argparse.Action):
    """``MODEL`` or ``--model MODEL``, not both. argparse calls the positional with None
    when it is absent: then ``--model`` or the default stands."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if values is None:
            return
        given = getattr(namespace, "_model_given", None)
        if given is not None and given != values:
            parser.error(f"the model is given twice ({given!r} and {values!r}): as MODEL or "
                         "--model, once")
        namespace._model_given = values
        setattr(namespace, self.dest, values)


def _checked(parse: Any, kind: type) -> Any:
    """An argparse ``type``: ``parse``'s ValueError becomes argparse's one-line usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(kind(text))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = kind.__name__
    return convert


def _scalar_type(option: EngineOption) -> type:
    """``int`` for ``int`` and ``int | None``; an unset optional flag keeps its None default.
    A structured option (``speculative_config``) names the text its flag takes in
    ``flag_type``."""
    kind = option.field.metadata.get("flag_type", option.type)
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


def lora_module(text: str) -> tuple[str, str]:
    """An argparse ``type``: vLLM's ``--lora-modules`` entry, ``NAME=PATH``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (a usage error naming the flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port_number(text: str) -> int:
    """An argparse ``type`` for ``--port``: 0-65535, refused before any model loads."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port
