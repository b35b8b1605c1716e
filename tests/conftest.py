"""Shared fixtures: tiny random-weight checkpoints written from configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
