"""vLLM's GET /load (the requests on the engine's routes being answered now) and
GET /tokenizer_info (the tokenizer's config, held to transformers' tokenizer)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from server_harness import SERVED_NAME, start_live_server

from kvloom.server.settings import ServerSettings


def test_load_counts_a_stream_until_it_ends_and_needs_no_key(tiny_llama: Path) -> None:
    """While two completions stream (a slow engine: 40 tokens take >= 0.8 s) the load is
    2; a request refused for its key, and /load itself, do not count; once the streams
    end it is back to 0."""
    settings = ServerSettings(served_model_name=SERVED_NAME, api_key="k")
    live = start_live_server(tiny_llama, settings, step_delay=0.02)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60, headers={"Authorization": "Bearer k"}) as http:
            assert httpx.get(f"{live.base_url}/load").json() == {"server_load": 0}  # no key needed
            common = {"model": SERVED_NAME, "max_tokens": 40, "ignore_eos": True, "stream": True}
            body = {**common, "prompt": [5, 6, 7]}
            chat = {**common, "messages": [{"role": "user", "content": "hi"}]}
            with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/chat/completions", json=chat) as second:
                assert first.status_code == second.status_code == 200
                # Held, not dropped: a dropped line iterator closes its response.
                lines = [first.iter_lines(), second.iter_lines()]
                for events in lines:
                    next(events)  # both are being answered
                assert httpx.post(f"{live.base_url}/v1/completions", json=body).status_code == 401
                assert http.get("/load").json() == {"server_load": 2}
                for events in lines:
                    for _ in events:
                        pass
            deadline = time.monotonic() + 10  # the server's side of a stream ends just after its last byte
            while http.get("/load").json()["server_load"] != 0:
                assert time.monotonic() < deadline, "the load never went back to 0"
            live.assert_idle_and_clean()
    finally:
        live.stop()


def test_tokenizer_info_is_transformers_tokenizer_config(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_llama)
    settings = ServerSettings(served_model_name=SERVED_NAME, enable_tokenizer_info_endpoint=True)
    live = start_live_server(tiny_llama, settings)
    try:
        info = httpx.get(f"{live.base_url}/tokenizer_info").json()
    finally:
        live.stop()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (reference.bos_token, reference.eos_token)
    assert info["chat_template"] == reference.chat_template
    assert info["model_max_length"] == 256  # the harness's context
    assert {int(i): (t["content"], t["special"]) for i, t in info["added_tokens_decoder"].items()} == \
        {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}


def test_tokenizer_info_is_off_unless_asked_for(http: httpx.Client) -> None:
    assert http.get("/tokenizer_info").status_code == 404
