"""POST /v1/embeddings through the official OpenAI client (whose default encoding is
base64) and plain HTTP: transformers' normalized last hidden state of each input."""

from __future__ import annotations

import re
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


def test_a_matryoshka_model_shortens_its_embeddings(tmp_path_factory: pytest.TempPathFactory) -> None:
    """OpenAI's dimensions on a model whose config.json lists matryoshka sizes (vLLM's
    keys): the first k values of transformers' last hidden state, normalized; a size it
    does not list, or past the hidden size, is a 400 naming what it may be."""
    import json

    from helpers_models import write_tiny_hf_model
    from server_harness import start_live_server

    from kvloom.server.settings import ServerSettings
    model = write_tiny_hf_model(tmp_path_factory.mktemp("matryoshka"), arch="llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    live = start_live_server(model, ServerSettings(served_model_name=SERVED_NAME))
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            ids = [5, 6, 7, 8, 9]
            transformers_model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
            with torch.no_grad():
                hidden = transformers_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            for size in (16, 32, None):
                body = {"input": ids, "encoding_format": "float", **({"dimensions": size} if size else {})}
                got = torch.tensor(http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"])
                expected = torch.nn.functional.normalize(hidden[:size], dim=-1)
                assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5), size
            for size, message in ((24, r"one of the model's matryoshka sizes \[16, 32, 64\]"),
                                  (0, r"must be in \[1, 64\]"), (65, r"must be in \[1, 64\]")):
                reply = http.post("/v1/embeddings", json={"input": ids, "dimensions": size})
                assert reply.status_code == 400 and reply.json()["error"]["param"] == "dimensions"
                assert re.search(message, reply.json()["error"]["message"]), reply.text
    finally:
        live.stop()


def test_a_chat_is_embedded_as_its_template_renders_it(http: httpx.Client, live_server: LiveServer,
                                                       tiny_llama: Path) -> None:
    """vLLM's chat-shaped embedding request: ``messages`` through the chat template (no
    generation prompt unless asked), one embedding: transformers' tokenizer renders the
    same ids and its model gives the same vector."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox"}]
    for opening in (False, True):
        body = {"messages": messages, "encoding_format": "float", "add_generation_prompt": opening}
        reply = http.post("/v1/embeddings", json=body)
        assert reply.status_code == 200, reply.text
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=opening, tokenize=True,
                                            return_dict=True)["input_ids"]
        assert reply.json()["usage"]["prompt_tokens"] == len(ids)
        assert torch.allclose(torch.tensor(reply.json()["data"][0]["embedding"]), reference(tiny_llama, ids), atol=1e-5)
    for body, message in (({"input": "a", "messages": messages}, "exactly one of input or messages"),
                          ({}, "exactly one of input or messages"), ({"messages": []}, "at least one message")):
        reply = http.post("/v1/embeddings", json=body)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    live_server.assert_idle_and_clean()
