"""Shared fixtures: tiny random-weight checkpoints written from configs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
