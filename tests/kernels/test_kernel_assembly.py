"""What the compiler made of the paired attention kernels, read from the built library.

GCC 12 once deleted every block prefetch of these kernels without a trace in any
result: the prefetch sat in a helper that held nothing else, GCC took the helper for
a pure function, and dropped its calls (paired.h's LineFeed, which now issues them, is always inlined
since). Only the machine code shows it, so this test reads it: every walk over the
blocks (each instance of attend_group_avx2 / _paired / _amx this CPU's build has)
must issue prefetches."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kvloom import native
from kvloom.kernels import paged_attention as kernels

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="paged_attention.cpp does not build here"),
              pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")]

_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def function_bodies(library: str) -> dict[str, list[str]]:
    """Each function's instructions, by demangled name."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library], check=True,
                             capture_output=True, text=True).stdout
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in listing.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = bodies.setdefault(match.group(1), [])
        elif current is not None and line.strip():
            current.append(line)
    return bodies


def test_every_paired_walk_prefetches_the_blocks_ahead() -> None:
    if not kernels.paired_layout(64, 16):
        pytest.skip("no paired layout on this CPU")
    bodies = function_bodies(native.load("paged_attention")._name)
    walks = {name: body for name, body in bodies.items()
             if re.search(r"attend_group_(avx2|paired|amx)<", name) and "@plt" not in name and ".cold" not in name}
    assert walks, "no paired walk found in the library's symbols"
    missing = [name for name, body in walks.items() if not any("prefetch" in line for line in body)]
    assert not missing, f"{len(missing)} of {len(walks)} walks issue no prefetch, e.g. {missing[0]}"
