"""vLLM's chat request fields beyond OpenAI's, on the tiny model: ``documents`` and
``reasoning_effort`` reach the template and a request's own ``chat_template`` (only where
the server trusts them), each prompt held to the template rendered here by jinja2 and
tokenized by Hugging Face ``tokenizers``; ``echo``; and ``request_id``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from helpers_models import TOOL_CHAT_TEMPLATE
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings

# Renders the documents, the effort and each message's content, nothing else.
TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
            "effort={{ reasoning_effort | default('unset') }}\n"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def trusting(tiny_llama: Path) -> Iterator[LiveServer]:
    # TEMPLATE is also its own (--chat-template), for the Responses API, which takes no template.
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME,  # room for a tools prompt
                                                        trust_request_chat_template=True), max_model_len=512,
                             chat_template=TEMPLATE)
    yield live
    live.stop()


def post(live: LiveServer, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", json={"model": SERVED_NAME, "max_tokens": 3, **body}, timeout=60)


def reference_prompt_tokens(model: Path, **variables: Any) -> int:
    """The prompt's length: TEMPLATE rendered by jinja2, tokenized by HF tokenizers."""
    from tokenizers import Tokenizer
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    text = environment.from_string(TEMPLATE).render(add_generation_prompt=True, **variables)
    return len(Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def test_documents_and_reasoning_effort_reach_a_requests_own_template(trusting: LiveServer, tiny_llama: Path) -> None:
    documents = [{"title": "Paged attention", "text": "KV in blocks."}, {"title": "Radix", "text": "Shared prefixes."}]
    for fields in ({}, {"documents": documents}, {"reasoning_effort": "high"},
                   {"documents": documents, "reasoning_effort": "low"}):
        reply = post(trusting, messages=HI, chat_template=TEMPLATE, **fields)
        assert reply.status_code == 200, reply.text
        expected = reference_prompt_tokens(tiny_llama, messages=HI, **fields)
        assert reply.json()["usage"]["prompt_tokens"] == expected, fields
    # chat_template_kwargs come after reasoning_effort: theirs is the value the template sees.
    reply = post(trusting, messages=HI, chat_template=TEMPLATE, reasoning_effort="high",
                 chat_template_kwargs={"reasoning_effort": "a much longer effort text"})
    assert reply.json()["usage"]["prompt_tokens"] == reference_prompt_tokens(
        tiny_llama, messages=HI, reasoning_effort="a much longer effort text")


def test_the_responses_apis_reasoning_effort_reaches_the_template(trusting: LiveServer, tiny_llama: Path) -> None:
    """vLLM's mapping: ``reasoning.effort`` is the template's ``reasoning_effort``, as
    chat's field is; the response echoes it. A summary has no summarizer here: a 400."""
    def respond(**fields: Any) -> httpx.Response:
        return httpx.post(f"{trusting.base_url}/v1/responses", timeout=60,
                          json={"model": SERVED_NAME, "input": "Hello there", "max_output_tokens": 3, **fields})

    for reasoning in (None, {"effort": "low"}, {"effort": "high", "summary": None}):
        reply = respond(reasoning=reasoning)
        assert reply.status_code == 200, reply.text
        effort = {} if reasoning is None else {"reasoning_effort": reasoning["effort"]}
        assert reply.json()["usage"]["input_tokens"] == reference_prompt_tokens(tiny_llama, messages=HI, **effort)
        assert reply.json()["reasoning"] == (None if reasoning is None else {"effort": effort["reasoning_effort"],
                                                                             "summary": None})
    for reasoning, param in (({"effort": "huge"}, "reasoning.effort"), ({"summary": "auto"}, "reasoning.summary"),
                             ({"effort": "low", "budget": 3}, "reasoning.budget")):
        refused = respond(reasoning=reasoning)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    trusting.assert_idle_and_clean()


def test_a_requests_template_needs_the_servers_trust(live_server: LiveServer, trusting: LiveServer) -> None:
    refused = post(live_server, messages=HI, chat_template=TEMPLATE)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    broken = post(trusting, messages=HI, chat_template="{% for m in messages %}")
    assert broken.status_code == 400 and "not a valid Jinja template" in broken.json()["error"]["message"]
    assert post(live_server, messages=HI, reasoning_effort="huge").status_code == 400


def test_echo_puts_the_continued_message_before_its_continuation(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon"}]
    common = dict(messages=messages, continue_final_message=True, add_generation_prompt=False, max_tokens=6,
                  temperature=0.0)
    plain = post(live_server, **common).json()["choices"][0]["message"]["content"]
    echoed = post(live_server, echo=True, **common).json()["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    streamed = ""
    with httpx.stream("POST", f"{live_server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": SERVED_NAME, "echo": True, "stream": True, **common}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert streamed == echoed
    # The last message is the user's: nothing to echo.
    assert post(live_server, messages=HI, echo=True, max_tokens=4, temperature=0.0).json()["choices"][0][
        "message"]["content"] == post(live_server, messages=HI, max_tokens=4, temperature=0.0).json()["choices"][0][
        "message"]["content"]


def test_a_clients_request_id_names_the_response_and_never_clashes(live_server: LiveServer) -> None:
    with ThreadPoolExecutor(4) as pool:  # the same id at once, chat and completions
        replies = list(pool.map(lambda path: post(live_server, path, request_id="trace-42", max_tokens=8,
                                                  **({"messages": HI} if "chat" in path else {"prompt": "Hi"})),
                                ["/v1/chat/completions", "/v1/chat/completions", "/v1/completions", "/v1/completions"]))
    assert [reply.status_code for reply in replies] == [200] * 4
    assert [reply.json()["id"] for reply in replies] == ["chatcmpl-trace-42"] * 2 + ["cmpl-trace-42"] * 2
    assert post(live_server, messages=HI, request_id="").status_code == 400


def test_tokenize_counts_a_chat_as_the_chat_request_would(trusting: LiveServer, tiny_llama: Path) -> None:
    """/tokenize takes the chat's template fields (tools, documents, a trusted template,
    continue_final_message): its count is the chat request's usage.prompt_tokens, and
    ``return_token_strs`` names each token as Hugging Face ``tokenizers`` does."""
    from tokenizers import Tokenizer
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    cases = [dict(messages=HI, tools=[weather], chat_template=TOOL_CHAT_TEMPLATE),  # Qwen2.5's: renders tools
             dict(messages=HI, chat_template=TEMPLATE, documents=[{"title": "A", "text": "B"}]),
             dict(messages=[*HI, {"role": "assistant", "content": "Once"}], continue_final_message=True,
                  add_generation_prompt=False)]
    counts = []
    for fields in cases:
        chat = post(trusting, **fields).json()["usage"]["prompt_tokens"]
        counted = httpx.post(f"{trusting.base_url}/tokenize", json={"return_token_strs": True, **fields}, timeout=60)
        assert counted.status_code == 200, counted.text
        assert counted.json()["count"] == len(counted.json()["tokens"]) == chat, fields
        counts.append(chat)
    without_tools = httpx.post(f"{trusting.base_url}/tokenize", timeout=60,
                               json={"messages": HI, "chat_template": TOOL_CHAT_TEMPLATE}).json()["count"]
    assert counts[0] > without_tools  # the tools were rendered
    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    reply = httpx.post(f"{trusting.base_url}/tokenize", json={"prompt": "Hello there", "return_token_strs": True},
                       timeout=60).json()
    assert reply["token_strs"] == [tokenizer.id_to_token(token) for token in reply["tokens"]]
