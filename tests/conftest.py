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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
