"""Shared fixtures: tiny random-weight checkpoints written from configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(2)

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
def default_model_reference() -> torch.nn.Module:
    """transformers' own float32 model from the default model's GGUF (loading it takes
    ~17 s on 2 cores: once per session, for every test that compares with it)."""
    import transformers
    from helpers_models import default_model_path

    gguf = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()
