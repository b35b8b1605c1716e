"""Real request bodies, as LangChain, LiteLLM, Open WebUI, the OpenAI Agents SDK and the
openai SDK send them (tests/server/client_corpus/*.json, written from their docs), each
posted to a live server: a 200 with a response the openai SDK's own types parse.

The server's model has a real tool-aware chat template (Qwen2.5's), and chat prompts are
checked against transformers' ``apply_chat_template`` on the same conversation, as its
tool-use docs shape it (developer read as system, tool-call arguments as objects): the
tools and tool messages reach the template as transformers would hand them over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_models import TOOL_CHAT_TEMPLATE, write_tiny_hf_model
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings

CORPUS = sorted((Path(__file__).parent / "client_corpus").glob("*.json"))
ENGINE = dict(max_model_len=2048, num_blocks=192)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-tools"), chat_template=TOOL_CHAT_TEMPLATE,
                               max_position_embeddings=2048)


@pytest.fixture(scope="module")
def corpus_server(tool_model: Path) -> Iterator[LiveServer]:
    live = start_live_server(tool_model, ServerSettings(served_model_name=SERVED_NAME), **ENGINE)
    yield live
    live.stop()


def reference_prompt_len(model: Path, body: dict[str, Any]) -> int:
    """Prompt tokens by transformers' apply_chat_template on the documented shapes."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    conversation = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        converted = {"role": "system" if message["role"] == "developer" else message["role"],
                     "content": content}
        if "tool_calls" in message:
            converted["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                converted[key] = message[key]
        conversation.append(converted)
    text = tokenizer.apply_chat_template(conversation, tools=body.get("tools") or None, tokenize=False,
                                         add_generation_prompt=True, **body.get("chat_template_kwargs", {}))
    return len(tokenizer.encode(text, add_special_tokens=False))


def check_chat(body: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if not body.get("stream"):
        completion = ChatCompletion.model_validate(response.json())
        assert len(completion.choices) == (body.get("n") or 1)
        for choice in completion.choices:
            assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
            assert choice.finish_reason in ("stop", "length")
        assert completion.usage is not None
        return completion.usage.model_dump()
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[len("data: "):]))
              for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert response.text.rstrip().endswith("data: [DONE]")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert usage is not None, "stream_options.include_usage sends a final usage chunk"
    return usage.model_dump()


def check_completion(body: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
    from openai.types import Completion

    completion = Completion.model_validate(response.json())
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert len(completion.choices) == len(prompts) * (body.get("n") or 1)
    assert all(choice.finish_reason in ("stop", "length") for choice in completion.choices)
    assert completion.usage is not None
    return completion.usage.model_dump()


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_client_body_gets_a_well_formed_200(corpus_server: LiveServer, tool_model: Path, path: Path) -> None:
    entry = json.loads(path.read_text())
    assert {"client", "documentation", "path", "body"} <= set(entry)
    body = entry["body"]
    with httpx.Client(base_url=corpus_server.base_url, timeout=120) as http:
        response = http.post(entry["path"], json=body)
    assert response.status_code == 200, response.text
    if entry["path"] == "/v1/chat/completions":
        usage = check_chat(body, response)
        assert usage["prompt_tokens"] == reference_prompt_len(tool_model, body)
    else:
        usage = check_completion(body, response)
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    assert 1 <= usage["completion_tokens"] <= limit * len(body.get("prompt", [0])) * (body.get("n") or 1)
    corpus_server.assert_idle_and_clean()


def test_corpus_covers_the_clients() -> None:
    clients = " ".join(json.loads(p.read_text())["client"] for p in CORPUS)
    for name in ("LangChain", "LiteLLM", "Open WebUI", "Agents SDK", "openai-python"):
        assert name in clients
    bodies = [json.loads(p.read_text())["body"] for p in CORPUS]
    assert any(b.get("parallel_tool_calls") is not None and b.get("tools") for b in bodies)
    assert any(m.get("role") == "tool" for b in bodies for m in b.get("messages", []))
