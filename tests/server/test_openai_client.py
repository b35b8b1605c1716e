"""The server through the official ``openai`` client: completions and chat, streamed
and not, n > 1, stop strings, seeds, logprobs, usage, multi-turn and token-id prompts."""

from __future__ import annotations

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(autouse=True)
def _no_leaks(live_server: LiveServer):
    yield
    live_server.assert_idle_and_clean()


def test_models_health_version(client, live_server: LiveServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert httpx.get(f"{live_server.base_url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{live_server.base_url}/version").json()
    # OpenAI's retrieval: the served model's card under the served name and an alias, else a 404.
    for name in (SERVED_NAME, "tiny-alias"):
        card = client.models.retrieve(name)
        assert card.id == SERVED_NAME and card.model_dump() == models.data[0].model_dump()
    import openai
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_completion(client) -> None:
    result = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=5,
                                       temperature=0)
    choice = result.choices[0]
    assert result.object == "text_completion" and result.model == SERVED_NAME
    assert choice.finish_reason == "length" and choice.text
    usage = result.usage
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_matches_non_stream(client) -> None:
    full = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_model_alias_and_path_accepted(client, live_server: LiveServer) -> None:
    for name in ("tiny-alias", live_server.async_engine.info.model_name):
        result = client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert result.model == SERVED_NAME


def test_chat_stream_matches_non_stream(client) -> None:
    full = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=8,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=8,
                                                 temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_samples_and_seed_reproducible(client) -> None:
    def sample():
        result = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=6,
                                                temperature=1.0, seed=1234, n=2)
        return [c.message.content for c in sorted(result.choices, key=lambda c: c.index)], result

    first, result = sample()
    assert [c.index for c in sorted(result.choices, key=lambda c: c.index)] == [0, 1]
    assert result.usage.completion_tokens == 12
    assert first[0] != first[1]  # seed + i: the samples are independent
    assert sample()[0] == first


def test_stop_string(client) -> None:
    base = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    # A short ASCII piece of the greedy output, not at its very start.
    start = next(i for i in range(2, len(base) - 2)
                 if base[i:i + 2].isascii() and base[i:i + 2].strip() == base[i:i + 2])
    stop = base[start:start + 2]
    result = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == base[:base.find(stop)]


def test_completion_logprobs(client) -> None:
    result = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client) -> None:
    result = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=4,
                                            logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_stream_usage_in_final_chunk(client) -> None:
    chunks = list(client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert final.usage.total_tokens == final.usage.prompt_tokens + 5


def test_continuous_usage_counts_every_chunk_so_far(client, http: httpx.Client) -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is the tokens sent up to it, counted
    here from the chunks' own token ids (return_token_ids), on chat and completions."""
    prompt_tokens = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    for create, extra in ((client.chat.completions.create, {"messages": CHAT}),
                          (client.completions.create, {"prompt": PROMPT})):
        chunks = list(create(model=SERVED_NAME, max_tokens=6, stream=True, **extra,
                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True, "return_token_ids": True}))
        sent = 0
        for chunk in chunks[:-1]:
            sent += len(getattr(chunk.choices[0], "token_ids", None) or [])
            assert chunk.usage.completion_tokens == sent
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + sent
        assert sent == chunks[-1].usage.completion_tokens == 6
        if "messages" in extra:
            assert chunks[0].usage.prompt_tokens == prompt_tokens


def test_multi_turn_chat_and_text_parts(client, http: httpx.Client) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    result = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=3)
    counted = http.post("/tokenize", json={"messages": messages}).json()
    assert result.usage.prompt_tokens == counted["count"] == len(counted["tokens"])


def test_token_id_prompts_and_echo(client, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    by_text = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=SERVED_NAME, prompt=[ids, ids[:2]], max_tokens=2,
                                      echo=True, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0].startswith(PROMPT) and texts[2].startswith(http.post(
        "/detokenize", json={"tokens": ids[:2]}).json()["prompt"])
    assert batch.usage.prompt_tokens == len(ids) + 2


def test_max_tokens_absent_runs_to_the_context(client) -> None:
    prompt = [100] * 250  # the served context (max_model_len) is 256
    result = client.completions.create(model=SERVED_NAME, prompt=prompt,
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 6


def test_structured_outputs_through_the_api(client) -> None:
    import json
    import re

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        data = json.loads(choice.message.content)
        assert set(data) == {"name", "age"} and 0 <= data["age"] <= 120
    else:
        assert choice.finish_reason == "length"
    text = client.completions.create(model=SERVED_NAME, prompt="Date:", max_tokens=20,
                                     extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text.choices[0].text)
    picked = client.completions.create(model=SERVED_NAME, prompt="Pick:", max_tokens=10,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].text in {"red", "green", "blue"}


def test_structural_tag_through_the_api(client) -> None:
    """vLLM's structural_tag: as response_format (xgrammar's spelling) on chat, as
    structured_outputs.structural_tag (JSON text, the legacy spelling) on completions;
    a format kvloom does not write is a 400 that names it."""
    import json
    import re

    import openai

    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
            "required": ["city"], "additionalProperties": False}
    call = {"type": "tag", "begin": "<f=city>", "content": {"type": "json_schema", "json_schema": city},
            "end": "</f>"}
    forced = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [call],
                                                   "separator": "\n", "at_least_one": True}}
    reply = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=40,
                                           temperature=0, response_format=forced)
    content = reply.choices[0].message.content
    calls = re.findall(r'<f=city>\{"city":"(Oslo|Lima)"\}</f>', content)
    assert calls and content.startswith("<f=city>")
    if reply.choices[0].finish_reason == "stop":
        assert content == "\n".join(f'<f=city>{{"city":"{c}"}}</f>' for c in calls)
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=city>", "schema": city, "end": "</f>"}]}
    text = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"structured_outputs": {"structural_tag": json.dumps(legacy)}}
                                     ).choices[0].text
    whole = [f'city>{{"city":"{c}"}}</f>' for c in ("Oslo", "Lima")]
    for opened in text.split("<f=")[1:]:  # every trigger opens a whole call (or the output ran out)
        assert any(opened.startswith(call) or call.startswith(opened) for call in whole), text
    with pytest.raises(openai.BadRequestError, match="'dispatch' is not supported"):
        client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=4, response_format={
            "type": "structural_tag", "format": {"type": "dispatch", "rules": []}})
