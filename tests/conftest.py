"""Shared fixtures: tiny random-weight checkpoints written from configs."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# `make test` runs two pytest workers (pytest-xdist) on the two cores, each with one
# compute thread: two processes of two OpenMP threads each on two cores spin against each
# other (the suite ran 2x slower). The kernels give the same bits at any thread count
# (tests/kernels/test_gemm.py and the decoder walk's tests hold them to it at several),
# and the tests of what a second thread changes set two themselves (`two_threads`). While
# both workers run such tests, four threads share two cores: OpenMP's threads then wait for
# work asleep rather than spinning (set before torch loads its OpenMP; the servers and ranks
# the tests start inherit it), which took the decoder walk's two-thread tests from 43 s to
# 18 s when both workers ran them. Speed only: no kernel's bits depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting above)
from hypothesis import settings  # noqa: E402

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two compute threads for this test (what the engine runs with on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

# CI runs the property tests on a fixed sequence of examples (reproducible, so a
# submission's result does not depend on the draw); elsewhere each run explores anew.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Without a GPU the Triton kernels (the CUDA backend's) run in Triton's interpreter on
# CPU tensors: read when a kernel is defined, so set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def transformers_gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF parse of the default model (gguf-py's reader: ~6 s here, most of
    it in numpy views of the 49k-token vocabulary) done once for the session: the
    tokenizer and the config fixtures each parse the same file, and get the same dicts
    (copies, as a caller may change its own)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return parse(path, return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    gguf_utils.load_gguf_checkpoint = once
    yield
    gguf_utils.load_gguf_checkpoint = parse


@pytest.fixture(scope="session")
def default_gguf_reader() -> Any:
    """gguf-py's reader of the default model's GGUF, parsed once for the session (its
    tensors stay memory-mapped; read-only)."""
    from helpers_models import default_model_path

    from kvloom.models import gguf_loader
    return gguf_loader.open_gguf(default_model_path())


@pytest.fixture(scope="session")
def default_llm_float32() -> Any:
    """The default model in float32 (the dtype of transformers' reference), one for the
    session: the tests against transformers share it (the prefix cache it keeps between
    them changes no token: that is the engine's exactness)."""
    from kvloom import LLM
    return LLM("smollm2-135m-instruct", dtype="float32", num_blocks=256)


@pytest.fixture(scope="session")
def default_model_reference(transformers_gguf_parsed_once: None) -> torch.nn.Module:
    """transformers' own float32 model of the default model: its configuration as
    transformers reads it from the GGUF, its weights the dequantized copy kvloom's loader
    caches, which tests/models/test_loader.py holds tensor for tensor to gguf-py's
    dequantization under transformers' own GGUF tensor processing (what transformers'
    GGUF load gives; ~7 s here, where that load takes ~17 s on 2 cores)."""
    import transformers
    from helpers_models import default_model_path

    from kvloom.models import loader

    gguf = default_model_path()
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loader.load_checkpoint(str(gguf))  # writes the dequantized copy if it is not there yet
    return transformers.AutoModelForCausalLM.from_pretrained(loader._gguf_cache_dir(gguf, None), config=config,
                                                             dtype=torch.float32).eval()
