"""Fixtures for the server tests: a module-scoped live server on the tiny model, the
official OpenAI client pointed at it, and a raw httpx client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings
from kvloom.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def live_server(tiny_llama: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_name=SERVED_NAME, model_aliases=("tiny-alias",))
    live = start_live_server(tiny_llama, settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[Any]:
    import openai

    # max_retries=0: a retried 503 or 500 would hide the server's first answer.
    with openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> torch.nn.Module:
    """transformers' own float32 model of the tiny checkpoint: what replies are held to."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    """The engine's tokenizer of the tiny checkpoint (its eos_token_ids are the engine's too)."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), num_blocks=8)).tokenizer
