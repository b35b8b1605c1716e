"""A server started with an API key, one running sequence and one waiting slot:
401 for missing/wrong keys (probes exempt), 503 when the waiting queue is full."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import CorsSettings, ServerSettings

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def guarded(tiny_llama: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_name=SERVED_NAME, api_key=KEY)
    live = start_live_server(tiny_llama, settings, max_waiting=1, max_num_seqs=1, step_delay=0.02)
    yield live
    live.stop()


@pytest.fixture
def http(guarded: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded.base_url, timeout=60) as c:
        yield c
    guarded.assert_idle_and_clean()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not-bearer"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/tokenize"])
def test_bad_or_missing_key_is_401(http: httpx.Client, headers: dict, path: str) -> None:
    response = http.request("GET" if path == "/v1/models" else "POST", path, json=BODY,
                            headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_key_checked_before_body(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert response.status_code == 401


def test_good_key_and_open_probes(http: httpx.Client) -> None:
    assert http.post("/v1/completions", json=BODY, headers=GOOD).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert http.get(path).status_code == 200, path


def test_openai_client_with_key(guarded: LiveServer) -> None:
    import openai

    with openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1).choices
    with openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="nope", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)


def test_anthropic_client_sends_its_key_as_x_api_key(guarded: LiveServer) -> None:
    """Anthropic's clients send x-api-key, not a bearer token; a bad key is a 401 in
    Anthropic's error shape (the SDK's AuthenticationError)."""
    import anthropic

    ask = dict(model=SERVED_NAME, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    with anthropic.Anthropic(base_url=guarded.base_url, api_key=KEY, max_retries=0) as client:
        assert client.messages.create(**ask).content is not None
    with anthropic.Anthropic(base_url=guarded.base_url, api_key="nope", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError):
            client.messages.create(**ask)
    refused = httpx.post(f"{guarded.base_url}/v1/messages", json=ask, headers={"x-api-key": "nope"})
    assert refused.status_code == 401
    assert refused.json() == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": refused.json()["error"]["message"]}}
    assert httpx.post(f"{guarded.base_url}/v1/completions", json=BODY, headers={"x-api-key": KEY}).status_code == 200


def test_full_waiting_queue_is_503(http: httpx.Client, guarded: LiveServer) -> None:
    long = {**BODY, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded.base_url, timeout=60, headers=GOOD) as a, \
            httpx.Client(base_url=guarded.base_url, timeout=60, headers=GOOD) as b:
        with a.stream("POST", "/v1/completions", json=long) as running:
            # Keep the iterator: dropping it would close the connection (a disconnect).
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            # max_num_seqs=1: the next request waits behind the running one.
            with b.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                guarded.wait_until(lambda s: s.num_waiting == 1)
                response = http.post("/v1/completions", json=BODY, headers=GOOD)
                assert response.status_code == 503
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
                assert response.headers["retry-after"]
    # Both streams were closed early: their requests are aborted (the fixture checks).


def test_a_group_larger_than_the_queue_is_400_not_503(http: httpx.Client) -> None:
    """max_waiting=1: two samples can never be queued at once, so retrying cannot help;
    the request is refused as bad input, and the server goes on serving."""
    response = http.post("/v1/completions", json={**BODY, "n": 2}, headers=GOOD)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "too_many_sequences")
    assert "2 sequences" in error["message"] and "--max-waiting 1" in error["message"]
    assert "retry-after" not in response.headers
    assert http.post("/v1/completions", json=BODY, headers=GOOD).status_code == 200


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_browsers_may_call_from_any_origin_by_default(http: httpx.Client) -> None:
    """vLLM's CORS defaults: a preflight is answered without the key, and a reply (a 401
    too) names the origin as allowed, so that a browser app can read it."""
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    for headers, status in ((GOOD, 200), ({}, 401)):
        reply = http.post("/v1/completions", json=BODY, headers={**headers, "Origin": "https://app.example"})
        assert (reply.status_code, reply.headers.get("access-control-allow-origin")) == (status, "*")


def test_allowed_origins_narrow_who_may_call(tiny_llama: Path) -> None:
    settings = ServerSettings(served_model_name=SERVED_NAME,
                              cors=CorsSettings(allowed_origins=("https://app.example",), allow_credentials=True))
    live = start_live_server(tiny_llama, settings)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as client:
            allowed = client.options("/v1/completions", headers=PREFLIGHT)
            assert allowed.status_code == 200
            assert allowed.headers["access-control-allow-origin"] == "https://app.example"
            assert allowed.headers["access-control-allow-credentials"] == "true"
            other = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
            assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
            reply = client.post("/v1/completions", json=BODY, headers={"Origin": "https://evil.example"})
            assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    finally:
        live.stop()
    with pytest.raises(ValueError, match="allowed_origins must be a list of non-empty strings"):
        CorsSettings(allowed_origins=("",))
