"""Build and load kvloom's C++ sources: plain C ABI libraries, no torch headers.

kvloom/kernels declares each exported function once (kernels/native_op.py): the kernels
as PyTorch ops ``torch.ops.kvloom.<name>`` with a schema and checks, the few scalar
queries (a cache layout, the CPU's best GEMM path) as typed functions; both call through
ctypes with the signature derived from that declaration. Nothing else calls them.

Each source in ``kvloom/csrc`` is compiled on first use with the system C++ compiler
(about a second: no torch headers) and cached under ``$KVLOOM_HOME/kernels``, keyed
by the source, the flags, the compiler version and the CPU's features (``-march=native``
code built on one machine must never load on another through a shared home).
Callers keep a pure-PyTorch reference for everything built here and fall back to it
when building fails.

Also here: the OpenMP runtime those kernels (and torch) run on, for the one call the
engine makes to it (``release_openmp_team``, when another thread takes the engine over).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from kvloom.paths import kvloom_home

SOURCES = Path(__file__).parent / "csrc"
# -ffast-math lets glibc's vector expf (libmvec) and reassociated sums in; the kernels
# rely on -inf for "no score yet", so infinities stay meaningful. It is a compile flag
# only: linked with it, a shared library carries crtfastmath.o, whose constructor sets
# flush-to-zero and denormals-are-zero for the whole process at load time (every torch
# op of that thread would then lose subnormals). So sources compile with FLAGS and link
# with LINK_FLAGS, in two steps.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only",
         "-fPIC", "-std=c++17"]
LINK_FLAGS = ["-shared", "-fopenmp"]
# Sources whose arithmetic order is a promise (the batch-invariant matmuls, latent attention) build
# without -ffast-math, so the compiler may not reassociate their sums. (GCC still contracts a
# product and the sum it feeds into one fma in C++ by default: a kernel that must round the
# product first says so, as latent_attention.cpp's rotary does with fp-contract=off.)
EXACT_SOURCES = frozenset({"gemm", "shm_collectives", "mxfp4_gemm", "latent_attention"})
_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
logger = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """A C++ source could not be built here (no compiler, or it failed)."""


def cache_dir() -> Path:
    return kvloom_home() / "kernels"


def flags_for(name: str) -> list[str]:
    if name in EXACT_SOURCES:
        return [flag for flag in FLAGS if flag not in ("-ffast-math", "-fno-finite-math-only")]
    return FLAGS


@functools.cache
def cpu_identity() -> str:
    """The CPU's model and feature flags: what ``-march=native`` code depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))  # the first CPU's lines: all cores are alike


def compiler() -> str | None:
    """The C++ compiler kvloom builds with: ``$CXX``, else g++ or c++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name and a rename, so a process
    killed mid-write leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=f".{path.name}.") as f:
        f.write(text)
    os.replace(f.name, path)


def build_key(name: str, compiler: str) -> str:
    """What a built library depends on: its source and the headers, the flags, the
    compiler's version and the CPU (``-march=native``)."""
    source = (SOURCES / f"{name}.cpp").read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    identity = " ".join(flags_for(name) + LINK_FLAGS) + version + cpu_identity()
    return hashlib.sha256(source + identity.encode()).hexdigest()[:16]


def compile_library(source: Path, target: Path, flags: list[str]) -> None:
    """Compile ``source`` with ``flags`` and link it into ``target``, in two steps (see
    FLAGS), through a temporary name: concurrent builders never see half a file.
    KernelUnavailable names the first error."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler (g++) found to build {source.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built, objects = Path(tmp) / target.name, Path(tmp) / f"{source.stem}.o"
        for command in ([cxx, *flags, "-c", str(source), "-o", str(objects)],
                        [cxx, *LINK_FLAGS, str(objects), "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                errors = [line for line in result.stderr.splitlines() if "error" in line]
                raise KernelUnavailable(f"building {source.name} failed: "
                                        + (errors[0] if errors else result.stderr.strip()[-300:]))
        os.replace(built, target)


def load(name: str) -> ctypes.CDLL:
    """Build (once per source/flags/compiler) and load ``csrc/<name>.cpp``."""
    with _lock:
        if name in _libraries:
            return _libraries[name]
        cxx = compiler()
        if cxx is None:
            raise KernelUnavailable(f"no C++ compiler (g++) found to build {name}.cpp")
        target = cache_dir() / f"{name}-{build_key(name, cxx)}.so"
        if not target.exists():
            compile_library(SOURCES / f"{name}.cpp", target, flags_for(name))
        library = ctypes.CDLL(str(target))
        _libraries[name] = library
        return library


@functools.cache
def load_optional(name: str) -> ctypes.CDLL | None:
    """``load(name)``, or None where it cannot be built here (logged once, the failure
    remembered): the caller then runs its PyTorch reference."""
    try:
        return load(name)
    except KernelUnavailable as error:
        logger.warning("C++ %s unavailable, using the PyTorch reference: %s", name, error)
        return None


def loaded_openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime that torch and kvloom's kernels run their parallel regions
    on, or None where none is loaded. Found by its soname, libgomp.so.1, among the loaded
    libraries only (RTLD_NOLOAD): the one the dynamic linker binds both to (torch's own
    copy). Other wheels bundle renamed copies (sentencepiece's libgomp-<hash>.so) whose
    teams are not ours."""
    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None
    return library if hasattr(library, "omp_pause_resource_all") else None


OMP_PAUSE_SOFT = 1  # omp.h's omp_pause_soft


@functools.cache
def _pause_resources() -> Callable[[int], int] | None:
    """omp_pause_resource_all of the loaded runtime, typed, or None: looked up once (the
    transfer threads release their team after every job)."""
    library = loaded_openmp()
    if library is None:
        return None
    function = library.omp_pause_resource_all
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def release_openmp_team() -> bool:
    """Release the calling thread's OpenMP team: libgomp's worker threads for it exit
    (joined before this returns), and a later parallel region on this thread starts a
    new team. Call it on a thread that is done computing, before another thread takes
    over: libgomp counts every team's threads, and once it manages more threads than
    there are CPUs it cuts each barrier's spin to ~100 iterations, so every parallel
    region of the thread that computes sleeps and wakes on a futex (a decode step
    12-28% slower on two cores; docs/results/issue17/genoa6/forward_thread.txt).
    Returns whether a runtime was there to ask."""
    pause = _pause_resources()
    return pause is not None and bool(pause(OMP_PAUSE_SOFT) == 0)
