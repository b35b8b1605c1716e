"""Fields real clients send: accepted when they change nothing, implemented when they
change the output (logit_bias, max_completion_tokens, developer, chat-template controls,
response_format on completions), each checked against a reference."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from helpers_models import write_tiny_hf_model
from server_harness import SERVED_NAME, LiveServer

from kvloom.server.errors import APIError
from kvloom.server.protocol import ChatMessage
from kvloom.server.serving_chat import encode_messages
from kvloom.tokenizer import Tokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello there"}]


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = http.post(path, json={"model": SERVED_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(http: httpx.Client, **body: Any) -> list[int]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_logit_bias_plus_100_makes_greedy_emit_the_token(http: httpx.Client, live_server: LiveServer) -> None:
    token = 300
    expected = http.post("/detokenize", json={"tokens": [token] * 5}).json()["prompt"]
    for path, body in ((COMPLETIONS, {"prompt": "hello"}), (CHAT, {"messages": USER})):
        out = post(http, path, **body, max_tokens=5, temperature=0, logit_bias={str(token): 100})
        choice = out["choices"][0]
        assert (choice.get("text") or choice["message"]["content"]) == expected
    live_server.assert_idle_and_clean()


def test_nulls_mean_not_given(http: httpx.Client) -> None:
    plain = post(http, CHAT, messages=USER, max_tokens=4, temperature=0)
    nulls = post(http, CHAT, messages=USER, max_tokens=4, temperature=0, n=None, stream=None, seed=None,
                 stop=None, logit_bias=None, logprobs=None, top_logprobs=None, stream_options=None,
                 presence_penalty=None, min_tokens=None, ignore_eos=None, priority=None, tools=[],
                 tool_choice="none", parallel_tool_calls=False, user="u", metadata={"k": "v"},
                 store=False, service_tier="default", chat_template_kwargs=None)
    assert nulls["choices"][0]["message"] == plain["choices"][0]["message"]
    completion = post(http, COMPLETIONS, prompt="hi", max_tokens=3, echo=None, logprobs=None, n=None,
                      temperature=0)
    assert completion["choices"][0]["text"] == post(http, COMPLETIONS, prompt="hi", max_tokens=3,
                                                    temperature=0)["choices"][0]["text"]


def test_max_completion_tokens_caps_the_output(http: httpx.Client) -> None:
    out = post(http, CHAT, messages=USER, max_completion_tokens=3, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"
    same = post(http, CHAT, messages=USER, max_completion_tokens=2, max_tokens=2, ignore_eos=True)
    assert same["usage"]["completion_tokens"] == 2


def test_developer_renders_as_system(http: httpx.Client) -> None:
    developer = tokenize(http, messages=[{"role": "developer", "content": "Be brief."}, *USER])
    system = tokenize(http, messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert developer == system
    out = post(http, CHAT, messages=[{"role": "developer", "content": "Be brief."}, *USER], max_tokens=2)
    assert out["usage"]["prompt_tokens"] == len(system)


def test_add_generation_prompt_false(http: httpx.Client) -> None:
    without = tokenize(http, messages=USER, add_generation_prompt=False)
    assert len(without) < len(tokenize(http, messages=USER))
    out = post(http, CHAT, messages=USER, max_tokens=2, add_generation_prompt=False)
    assert out["usage"]["prompt_tokens"] == len(without)


def test_tool_messages_with_content_render_in_a_plain_template(http: httpx.Client) -> None:
    messages = [*USER, {"role": "assistant", "content": "calling", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = post(http, CHAT, messages=messages, max_tokens=2)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_add_special_tokens_false_leaves_the_bos_out(http: httpx.Client, tmp_path: Path) -> None:
    import transformers

    from kvloom.server.generation import encode_prompts
    model = write_tiny_hf_model(tmp_path / "bos")
    config = {**json.loads((model / "tokenizer_config.json").read_text()), "add_bos_token": True}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(model)
    bare = reference("hello there", add_special_tokens=False)["input_ids"]
    with_bos = [reference.convert_tokens_to_ids(config["bos_token"]), *bare]  # what add_bos_token asks for
    info = SimpleNamespace(tokenizer=Tokenizer.from_file(model / "tokenizer.json", config))
    for special, expected in ((True, with_bos), (False, bare)):
        assert encode_prompts("hello there", info, special)[0] == [expected]  # type: ignore[arg-type]
        assert encode_prompts(["hello there"] * 2, info, special)[0] == [expected] * 2  # type: ignore[arg-type]
    # Over HTTP the field reaches the tokenizer (this server's has no BOS: the same ids).
    plain = post(http, COMPLETIONS, prompt="hello there", max_tokens=4, temperature=0, add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == len(tokenize(http, prompt="hello there", add_special_tokens=False))


def test_response_format_on_completions(http: httpx.Client) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    for seed in range(3):
        out = post(http, COMPLETIONS, prompt="Answer:", max_tokens=20, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop" and json.loads(choice["text"]) in ("yes", "no"), choice


# ---- the template render, against transformers -------------------------------------------
KWARGS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module")
def kwargs_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-kwargs"), chat_template=KWARGS_TEMPLATE)


def ours(model: Path, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    config = json.loads((model / "tokenizer_config.json").read_text())
    info = SimpleNamespace(tokenizer=Tokenizer.from_file(model / "tokenizer.json", config))
    return encode_messages([ChatMessage.model_validate(m) for m in messages], info, **options)  # type: ignore[arg-type]


def reference(model: Path, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(kwargs_model: Path) -> None:
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        assert ours(kwargs_model, USER, add_generation_prompt=True, template_kwargs=kwargs) == \
            reference(kwargs_model, USER, add_generation_prompt=True, **kwargs)
    assert ours(kwargs_model, USER, add_generation_prompt=True, template_kwargs={"enable_thinking": False}) != \
        ours(kwargs_model, USER, add_generation_prompt=True)


def test_continue_final_message_matches_transformers(kwargs_model: Path) -> None:
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    assert ours(kwargs_model, messages, add_generation_prompt=False, continue_final_message=True) == \
        reference(kwargs_model, messages, add_generation_prompt=False, continue_final_message=True)


def test_unrenderable_message_is_named(kwargs_model: Path) -> None:
    """A tool-calls-only assistant turn (content null) renders as "" on a template that
    concatenates content; a message the template refuses is named in the 400."""
    calls_only = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    concat = write_tiny_hf_model(kwargs_model.parent / "concat")  # CHATML: role + content
    assert ours(concat, [*USER, calls_only, *USER], add_generation_prompt=True) == ours(
        concat, [*USER, {"role": "assistant", "content": ""}, *USER], add_generation_prompt=True)
    refusing = write_tiny_hf_model(kwargs_model.parent / "refusing", chat_template=(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"))
    with pytest.raises(APIError) as raised:
        ours(refusing, [*USER, calls_only, {"role": "tool", "tool_call_id": "c", "content": "42"}],
             add_generation_prompt=True)
    assert raised.value.param == "messages[2]"

def test_prompt_logprobs_over_http_equal_the_offline_api(http: httpx.Client, live_server: LiveServer,
                                                         tiny_llama: Path) -> None:
    """vLLM's prompt_logprobs: on each completions choice, on the chat response; the
    same values the offline engine reports (tests/engine/test_prompt_logprobs.py holds
    those to transformers)."""
    from kvloom import LLM, SamplingParams

    prompt = [5, 17, 99, 250, 41, 7]
    out = post(http, COMPLETIONS, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    wire = out["choices"][0]["prompt_logprobs"]
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    offline = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert wire[0] is None and len(wire) == len(prompt)
    for position in range(1, len(prompt)):
        expected = offline.prompt_logprobs[position]
        assert set(wire[position]) == {str(token_id) for token_id in expected}
        token = prompt[position]
        assert wire[position][str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)
        assert wire[position][str(token)]["rank"] == expected[token].rank
    chat = post(http, CHAT, messages=USER, max_tokens=1, prompt_logprobs=0)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    # kvloom's prompt_logprobs_start: only from token 3 on (the positions before are null).
    # The first request's tail serves this one's first 2 tokens, so it computes 4 rows, not
    # 6, and in float32 the matmuls are torch's, which are not row-invariant (bf16's are):
    # the same tokens and ranks, logprobs within float32 rounding.
    late = post(http, COMPLETIONS, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2,
                prompt_logprobs_start=3)
    assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    late = late["choices"][0]["prompt_logprobs"]
    assert late[:3] == [None, None, None] and len(late) == len(wire)
    for got, expected in zip(late[3:], wire[3:], strict=True):
        assert {k: v["rank"] for k, v in got.items()} == {k: v["rank"] for k, v in expected.items()}
        assert [v["logprob"] for v in got.values()] == pytest.approx([v["logprob"] for v in expected.values()],
                                                                     abs=1e-5)
    live_server.assert_idle_and_clean()


def streamed_completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    """A streamed completion of one choice folded into the full response's shape: the
    chunks' text and legacy logprobs lists concatenated, the last finish_reason, the usage."""
    text, finish, usage_ = "", None, None
    logprobs: dict[str, list[Any]] | None = None
    with http.stream("POST", COMPLETIONS, json={"model": SERVED_NAME, **body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage_ = chunk.get("usage") or usage_
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                if choice["logprobs"] is not None:
                    logprobs = logprobs or {key: [] for key in choice["logprobs"]}
                    for key, values in choice["logprobs"].items():
                        logprobs[key] += values
    return {"choices": [{"text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": usage_}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
@pytest.mark.parametrize("max_tokens", [0, 1], ids=["prompt only", "one token"])
def test_echo_with_logprobs_scores_the_prompt_as_transformers(http: httpx.Client, live_server: LiveServer,
                                                              tiny_llama: Path, max_tokens: int, stream: bool) -> None:
    """lm-eval's loglikelihood request (``echo``, ``logprobs``, ``max_tokens`` 0 or 1): the
    legacy logprobs list the prompt's tokens first (the first unscored), each the
    log-probability transformers gives it after the tokens before it. Streamed (vLLM's),
    the prompt and its logprobs come with the first token's chunk."""
    import torch
    import transformers

    prompt = [5, 17, 99, 250, 41, 7]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 1}
    out = streamed_completion(http, **body) if stream else post(http, COMPLETIONS, **body)
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + max_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt)):
        expected = reference[position - 1, prompt[position]].item()
        assert logprobs["token_logprobs"][position] == pytest.approx(expected, abs=1e-4), position
        assert max(logprobs["top_logprobs"][position].values()) == pytest.approx(
            reference[position - 1].max().item(), abs=1e-4)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    assert "prompt_logprobs" not in choice  # asked for through echo, not as vLLM's field
    if max_tokens == 0:  # vLLM's echo without generation
        assert out["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
        assert choice["text"] == "".join(logprobs["tokens"])
    else:  # greedy: the generated token is the reference's most likely one
        assert logprobs["token_logprobs"][-1] == pytest.approx(reference[-1].max().item(), abs=1e-4)
        assert out["usage"]["completion_tokens"] == 1
    live_server.assert_idle_and_clean()


# ---- vLLM's sampling extensions: allowed_token_ids, bad_words, detokenization switches ----


def _text(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_allowed_token_ids_and_bad_words_restrict_greedy(http: httpx.Client, live_server: LiveServer) -> None:
    # Two tokens whose text is a word (no space before it) that tokenizes back to them
    # alone, so that a bad word names exactly one token.
    texts = {t: http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in range(300, 400)}
    first, second = [t for t, text in texts.items() if text.isalpha()
                     and tokenize(http, prompt=text, add_special_tokens=False) == [t]][:2]
    word = texts[first]
    expected = {tokens: http.post("/detokenize", json={"tokens": list(tokens)}).json()["prompt"]
                for tokens in ((first,) * 5, (second,) * 5)}
    for path, body in ((COMPLETIONS, {"prompt": "hello"}), (CHAT, {"messages": USER})):
        # Only `first` may be sampled: greedy emits it whatever the model prefers.
        only = post(http, path, **body, max_tokens=5, temperature=0, ignore_eos=True, allowed_token_ids=[first])
        assert _text(only["choices"][0]) == expected[(first,) * 5]
        # ... and with `first` a bad word, only `second` is left.
        pair = post(http, path, **body, max_tokens=5, temperature=0, ignore_eos=True,
                    allowed_token_ids=[first, second], logit_bias={str(first): 50}, bad_words=[word])
        assert _text(pair["choices"][0]) == expected[(second,) * 5]
    live_server.assert_idle_and_clean()


@pytest.mark.parametrize("field, value, match", [
    ("allowed_token_ids", [5, 100000], "allowed_token_ids"),
    ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
    ("bad_words", "word", "bad_words"),
    ("bad_words", [""], "bad_words must be non-empty strings"),
    ("skip_special_tokens", "no", "skip_special_tokens"),
])
def test_vllm_sampling_extensions_refuse_bad_values(http: httpx.Client, field: str, value: Any, match: str) -> None:
    response = http.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert match in error["message"] and error["param"] == field


def test_skip_special_tokens_false_keeps_them_in_the_text(http: httpx.Client) -> None:
    # Token 1 is <|im_start|>, a special token that is not EOS: forced by logit_bias.
    forced = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}
    assert post(http, COMPLETIONS, **forced)["choices"][0]["text"] == ""
    kept = post(http, COMPLETIONS, **forced, skip_special_tokens=False)["choices"][0]["text"]
    assert kept == http.post("/detokenize", json={"tokens": [1, 1, 1]}).json()["prompt"] == "<|im_start|>" * 3


def test_include_stop_str_in_output(http: httpx.Client) -> None:
    plain = post(http, COMPLETIONS, prompt="hello", max_tokens=12, temperature=0, ignore_eos=True)
    text = plain["choices"][0]["text"]
    stop = text[3:5]
    assert stop.strip() and text.index(stop) == 3  # a stop string that first occurs at 3
    cut = post(http, COMPLETIONS, prompt="hello", max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    kept = post(http, COMPLETIONS, prompt="hello", max_tokens=12, temperature=0, ignore_eos=True, stop=stop,
                include_stop_str_in_output=True)
    assert cut["choices"][0]["text"] == text[:3] and cut["choices"][0]["finish_reason"] == "stop"
    assert kept["choices"][0]["text"] == text[:5] and kept["choices"][0]["finish_reason"] == "stop"


def test_truncate_prompt_tokens_keeps_the_last_k(http: httpx.Client) -> None:
    ids = list(range(300, 320))
    same = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = post(http, COMPLETIONS, prompt=ids, truncate_prompt_tokens=5, echo=True, **same)
    alone = post(http, COMPLETIONS, prompt=ids[-5:], **same)
    assert cut["usage"]["prompt_tokens"] == 5
    kept_text = http.post("/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert cut["choices"][0]["text"] == kept_text + alone["choices"][0]["text"]  # echo: what was kept
    whole = post(http, COMPLETIONS, prompt=ids, truncate_prompt_tokens=-1, **same)  # -1: the context
    assert whole["usage"]["prompt_tokens"] == 20
    chat = post(http, CHAT, messages=USER, truncate_prompt_tokens=3, **same)
    assert chat["usage"]["prompt_tokens"] == 3
    for bad in (0, -2, 10**6):
        response = http.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "hi", "truncate_prompt_tokens": bad})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "truncate_prompt_tokens"
        assert error["code"] == "invalid_value"


def test_allowed_token_ids_with_a_grammar_is_refused_by_name(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"}):
        response = http.post(CHAT, json={"model": SERVED_NAME, "messages": USER, "allowed_token_ids": [5], **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "allowed_token_ids" and "structured output" in error["message"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http: httpx.Client) -> None:
    same = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
    completion = post(http, COMPLETIONS, prompt="hello", logprobs=2, echo=True, **same)["choices"][0]
    named = completion["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in named["tokens"]]
    assert all(token.startswith("token_id:") for token in named["tokens"])
    # Each id is the token whose text the choice holds there: the prompt's, then the output's.
    texts = [http.post("/detokenize", json={"tokens": [i]}).json()["prompt"] for i in ids]
    assert "".join(texts) == completion["text"]
    assert named["text_offset"] == [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    for top, token in zip(named["top_logprobs"][1:], named["tokens"][1:], strict=True):
        assert token in top and all(key.startswith("token_id:") for key in top)
    chat = post(http, CHAT, messages=USER, logprobs=True, top_logprobs=2, **same)["choices"][0]
    content = chat["logprobs"]["content"]
    chat_ids = [int(item["token"].removeprefix("token_id:")) for item in content]
    assert http.post("/detokenize", json={"tokens": chat_ids}).json()["prompt"] == chat["message"]["content"]
    assert all(alt["token"].startswith("token_id:") for item in content for alt in item["top_logprobs"])
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_cache_salt_shares_the_prefix_cache_within_a_salt_only(http: httpx.Client, live_server: LiveServer) -> None:
    prompt = list(range(420, 500))  # five blocks of 16 no other test of this module sends
    same = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(**extra: Any) -> int:
        return post(http, COMPLETIONS, **same, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-x") == 0
    assert cached(cache_salt="tenant-y") == 0  # the same tokens, another tenant
    assert cached() == 0  # nor unsalted requests
    assert cached(cache_salt="tenant-x") == 79  # the whole prompt but its last token
    response = http.post(COMPLETIONS, json={"model": SERVED_NAME, **same, "cache_salt": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
    live_server.assert_idle_and_clean()


def test_reset_prefix_cache_over_http(http: httpx.Client, live_server: LiveServer) -> None:
    """vLLM's POST /reset_prefix_cache: the same prompt hits before it and not after."""
    prompt = list(range(40, 80))

    def cached() -> int:
        return post(http, COMPLETIONS, prompt=prompt, max_tokens=2, temperature=0)["usage"][
            "prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() == 39
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"reset": True}
    assert cached() == 0
    live_server.assert_idle_and_clean()


def _stream_events(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": SERVED_NAME, "stream": True, **body}) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_return_token_ids_are_the_prompt_and_transformers_greedy_tokens(http: httpx.Client, live_server: LiveServer,
                                                                       tiny_llama: Path) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole or streamed."""
    import torch
    import transformers
    from helpers_models import hf_greedy_with_cache

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = tokenize(http, prompt="the river runs")
    greedy = hf_greedy_with_cache(reference, prompt, 6)
    full = post(http, COMPLETIONS, prompt="the river runs", max_tokens=6, temperature=0, ignore_eos=True, n=2,
                return_token_ids=True)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in full["choices"]] == [(prompt, greedy)] * 2
    events = _stream_events(http, COMPLETIONS, prompt="the river runs", max_tokens=6, temperature=0,
                            ignore_eos=True, return_token_ids=True)
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == greedy
    assert "token_ids" not in post(http, COMPLETIONS, prompt="x", max_tokens=2)["choices"][0]
    # Chat: the prompt's ids on the response (the first chunk of a stream), each choice's own.
    messages = [{"role": "user", "content": "where does the river run"}]
    chat_prompt = tokenize(http, messages=messages, add_generation_prompt=True)
    chat_greedy = hf_greedy_with_cache(reference, chat_prompt, 5)
    chat = post(http, CHAT, messages=messages, max_tokens=5, temperature=0, ignore_eos=True, return_token_ids=True)
    assert (chat["prompt_token_ids"], chat["choices"][0]["token_ids"]) == (chat_prompt, chat_greedy)
    events = _stream_events(http, CHAT, messages=messages, max_tokens=5, temperature=0, ignore_eos=True,
                            return_token_ids=True)
    with_ids = [e for e in events if e["choices"] and "token_ids" in e["choices"][0]]
    assert with_ids[0]["prompt_token_ids"] == chat_prompt
    assert [t for e in with_ids for t in e["choices"][0]["token_ids"]] == chat_greedy
    live_server.assert_idle_and_clean()
