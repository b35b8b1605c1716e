"""Errors a program author can act on: what went wrong, and the line of the program."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Where:
    """A line of the user's program (the first frame outside kvloom.lang)."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno} in {self.function}"


def caller() -> Where | None:
    for frame in inspect.stack(context=0)[1:]:
        if os.path.dirname(os.path.abspath(frame.filename)) != _HERE:
            return Where(frame.filename, frame.lineno, frame.function)
    return None


class LangError(Exception):
    """A kvloom.lang program went wrong; ``where`` is the program's line."""

    def __init__(self, message: str, where: Where | None = None) -> None:
        self.message, self.where = message, where
        super().__init__(f"{message} (at {where})" if where is not None else message)


class EngineFault(RuntimeError):
    """The in-process engine failed in a step: every call then waiting fails with it (not
    a verdict on the call's own input, which is a ValueError)."""


class BackendClosed(RuntimeError):
    """A call on a ``kl.Local`` backend after (or across) its ``close()``."""
