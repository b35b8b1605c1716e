"""What scripts/avx512_emulated and scripts/amx_emulated share: kernels built from an
emulated copy of kvloom/csrc into a temporary ``$KVLOOM_HOME`` under the names
``kvloom.native.load`` looks for (so the tests load them unchanged), each refused if its
disassembly still holds instructions this CPU lacks, and the tests run against them."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvloom import native

ROOT = Path(__file__).resolve().parents[1]


def build(home: Path, names: Sequence[str] | None, emulated_source: Callable[[Path], str], include: Path,
          defines: Sequence[str], forbidden: str, what: str) -> None:
    """The kernels ``names`` (None: every kvloom/csrc/*.cpp), each source rewritten by
    ``emulated_source``, into ``home``/kernels, compiled two at a time; SystemExit where one
    does not build or its disassembly matches ``forbidden`` (real ``what`` instructions).
    The other kernels' native builds, where this machine has made them already (the
    suite's earlier tests do), are linked in rather than built again."""
    cxx = native.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    built = native.cache_dir()  # this machine's own builds, before the redirect below
    # Emulated builds are kept too, beside them, by a key of their rewritten source: a run
    # on an unchanged tree links them instead of compiling them again (~18 s for AMX's).
    kept = built.parent / "kernels-emulated"
    os.environ["KVLOOM_HOME"] = str(home)  # native.cache_dir() reads it
    native.cache_dir().mkdir(parents=True, exist_ok=True)  # a kept build is linked into it before any is built
    if names is not None:  # the kernels left native: their current builds, where made already
        for source in sorted(native.SOURCES.glob("*.cpp")):
            library = f"{source.stem}-{native.build_key(source.stem, cxx)}.so"
            if source.stem not in names and (built / library).exists():
                os.symlink(built / library, native.cache_dir() / library)
    with tempfile.TemporaryDirectory() as tmp:
        sources = Path(tmp) / "csrc"
        shutil.copytree(native.SOURCES, sources)
        cpps = sorted(sources.glob("*.cpp")) if names is None else [sources / f"{name}.cpp" for name in names]

        def compile_one(cpp: Path) -> None:
            text = emulated_source(cpp)
            cpp.write_text(text)
            target = native.cache_dir() / f"{cpp.stem}-{native.build_key(cpp.stem, cxx)}.so"
            flags = [*native.flags_for(cpp.stem), *defines, "-I", str(include)]
            headers = b"".join(h.read_bytes() for h in sorted([*sources.glob("*.h"), *include.glob("*.h")]))
            key = hashlib.sha256(text.encode() + headers + " ".join(flags).encode()
                                 + native.build_key(cpp.stem, cxx).encode()).hexdigest()[:16]
            cached = kept / f"{cpp.stem}-{what}-{key}.so"
            if cached.exists():  # built and checked by an earlier run of this same source
                os.symlink(cached, target)
                print(f"linked {cpp.stem} ({what} emulated, built before)", flush=True)
                return
            try:
                native.compile_library(cpp, target, flags)
            except native.KernelUnavailable as error:
                raise SystemExit(f"emulated: {error}") from None
            disassembly = subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True).stdout
            if re.search(forbidden, disassembly):  # the point of the exercise: nothing this CPU cannot run
                raise SystemExit(f"{target.name} holds real {what} instructions")
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(target, cached.with_suffix(".tmp"))
            os.replace(cached.with_suffix(".tmp"), cached)  # whole, or not there
            print(f"built {cpp.stem} ({what} emulated)", flush=True)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(compile_one, cpps))


def run_tests(home: Path, cpu_flags: str, pytest_args: Sequence[str]) -> int:
    """pytest over ``pytest_args`` against the builds in ``home``, the tests told (through
    tests/helpers_cpu.py's variable) that the build has ``cpu_flags`` too."""
    env = dict(os.environ, KVLOOM_HOME=str(home), KVLOOM_TEST_EMULATED_CPU_FLAGS=cpu_flags)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          cwd=ROOT, env=env).returncode
