"""POST /v1/embeddings through the official OpenAI client (whose default encoding is
base64) and plain HTTP: transformers' normalized last hidden state of each input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_harness import SERVED_NAME, LiveServer

transformers = pytest.importorskip("transformers")


def reference(tiny_llama: Path, prompt: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    return torch.nn.functional.normalize(hidden[0, -1], dim=-1)


def test_embeddings_match_transformers(client: Any, http: httpx.Client, live_server: LiveServer,
                                       tiny_llama: Path) -> None:
    texts = ["the quick brown fox", "jumps over the lazy dog again"]
    response = client.embeddings.create(model=SERVED_NAME, input=texts)  # base64 on the wire
    tokens = [http.post("/tokenize", json={"prompt": text}).json()["tokens"] for text in texts]
    assert [d.index for d in response.data] == [0, 1] and response.model == SERVED_NAME
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, tokens))
    for ids, data in zip(tokens, response.data, strict=True):
        assert torch.allclose(torch.tensor(data.embedding), reference(tiny_llama, ids), atol=1e-5)
    floats = http.post("/v1/embeddings", json={"input": [5, 6, 7, 8], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert torch.allclose(torch.tensor(floats["data"][0]["embedding"]), reference(tiny_llama, [5, 6, 7, 8]),
                          atol=1e-5)
    live_server.assert_idle_and_clean()


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "hi", "dimensions": 8}, "dimensions", "dimensions is not supported"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ["a", ""]}, "input", "input must not be empty"),
    ({"input": [[5, 6], list(range(3, 300))]}, "input[1]", "297 tokens"),
    ({"input": "hi", "encoding_format": "binary"}, None, None),
])
def test_bad_embedding_requests_are_named(http: httpx.Client, live_server: LiveServer, body: dict[str, Any],
                                          param: str | None, message: str | None) -> None:
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param and message in error["message"]
    live_server.assert_idle_and_clean()
