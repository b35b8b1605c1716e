"""--enable-responses-store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): stored responses are
returned by GET /v1/responses/{id} and deleted by DELETE, and a request naming one as
``previous_response_id`` answers the whole conversation: transformers' greedy reply to the
chat of the first turn, its answer and the new input (instructions do not carry over)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_harness import SERVED_NAME, LiveServer, start_live_server
from test_responses_api import expected_text

from kvloom.server.settings import ServerSettings
from kvloom.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def storing(tiny_llama: Path) -> Iterator[LiveServer]:
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME, enable_responses_store=True))
    yield live
    live.stop()


@pytest.fixture
def openai_client(storing: LiveServer) -> Iterator[Any]:
    import openai
    with openai.OpenAI(base_url=f"{storing.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_a_continued_response_answers_the_whole_conversation(openai_client: Any, storing: LiveServer,
                                                             reference: torch.nn.Module,
                                                             tokenizer: Tokenizer) -> None:
    first = openai_client.responses.create(model=SERVED_NAME, instructions="Be brief.", input="hello there",
                                           max_output_tokens=6, temperature=0)
    assert first.store is True and first.previous_response_id is None
    with httpx.Client(base_url=storing.base_url, timeout=60) as http:
        assert http.get(f"/v1/responses/{first.id}").json() == first.model_dump(mode="json", exclude_unset=True)
        second = openai_client.responses.create(model=SERVED_NAME, previous_response_id=first.id,
                                                input="and then?", max_output_tokens=6, temperature=0)
        conversation = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "and then?"}]
        text, prompt_len, _ = expected_text(http, reference, tokenizer, conversation, 6)
        assert second.output_text == text and second.usage.input_tokens == prompt_len
        assert second.previous_response_id == first.id
        # A third turn, streamed, continues the second (the chain, not just one link).
        events = list(openai_client.responses.create(model=SERVED_NAME, previous_response_id=second.id,
                                                     input="why?", max_output_tokens=6, temperature=0, stream=True))
        third = events[-1].response
        text, prompt_len, _ = expected_text(http, reference, tokenizer, [
            *conversation, {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "why?"}], 6)
        assert third.output_text == text and third.usage.input_tokens == prompt_len
        assert http.get(f"/v1/responses/{third.id}").json() == third.model_dump(mode="json", exclude_unset=True)
        # Deleted, it is gone; a response with store false is never kept.
        assert http.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response",
                                                                   "deleted": True}
        assert http.get(f"/v1/responses/{first.id}").status_code == 404
        unstored = openai_client.responses.create(model=SERVED_NAME, input="hi", max_output_tokens=2, store=False)
        assert unstored.store is False and http.get(f"/v1/responses/{unstored.id}").status_code == 404
        missing = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi",
                                                   "previous_response_id": first.id})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    storing.assert_idle_and_clean()


def test_without_the_store_nothing_is_kept(http: httpx.Client) -> None:
    assert http.get("/v1/responses/resp_x").status_code == 404


def test_the_store_keeps_the_most_recent_and_each_conversation() -> None:
    from kvloom.server.response_store import ResponseStore

    store = ResponseStore(capacity=2)
    for index in range(3):
        store.put({"id": f"r{index}", "output": [{"type": "message", "content": f"out{index}"}]},
                  [{"role": "user", "content": f"in{index}"}])
    assert store.get("r0") is None and len(store) == 2  # the least recent went
    kept = store.get("r2")
    assert kept is not None and kept.conversation == [{"role": "user", "content": "in2"},
                                                      {"type": "message", "content": "out2"}]
    assert store.delete("r1") and not store.delete("r1") and store.get("r1") is None
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ResponseStore(capacity=0)


def test_a_background_response_is_fetched_when_done(openai_client: Any, storing: LiveServer) -> None:
    kwargs = dict(model=SERVED_NAME, input="hello there", max_output_tokens=6, temperature=0)
    queued = openai_client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    deadline = time.monotonic() + 30
    while (fetched := openai_client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never ended"
    assert fetched.output_text == openai_client.responses.create(**kwargs).output_text
    assert fetched.status in ("completed", "incomplete") and fetched.usage.output_tokens > 0
    # Cancelling one that has ended returns it as it is; a response that was not a
    # background one cannot be cancelled.
    assert openai_client.responses.cancel(queued.id).status == fetched.status
    with httpx.Client(base_url=storing.base_url, timeout=60) as http:
        plain = openai_client.responses.create(**kwargs)
        refused = http.post(f"/v1/responses/{plain.id}/cancel")
        assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
        for body in ({"background": True, "store": False}, {"background": True, "stream": True}):
            response = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi", **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == "background"
    storing.assert_idle_and_clean()


def test_a_cancelled_background_response_stops_its_request(tiny_llama: Path) -> None:
    """A slow engine (each step >= 0.2 s): the cancel arrives while the request runs."""
    settings = ServerSettings(served_model_name=SERVED_NAME, enable_responses_store=True)
    live = start_live_server(tiny_llama, settings, step_delay=0.2)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            queued = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hello", "background": True,
                                                      "max_output_tokens": 200}).json()
            cancelled = http.post(f"/v1/responses/{queued['id']}/cancel").json()
            assert cancelled["status"] == "cancelled" and cancelled["id"] == queued["id"]
            assert http.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
            live.assert_idle_and_clean()  # its engine request was aborted, its blocks freed
    finally:
        live.stop()


def test_a_background_response_that_hits_a_bug_ends_failed(storing: LiveServer, monkeypatch) -> None:
    """A bug while a background response is generated ends it as failed, not in progress
    for ever; the server goes on."""
    import kvloom.server.serving_responses as serving_responses

    def broken(output: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(serving_responses, "check_finished_cleanly", broken)
    with httpx.Client(base_url=storing.base_url, timeout=60) as http:
        queued = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi", "background": True,
                                                  "max_output_tokens": 3}).json()
        deadline = time.monotonic() + 30
        while (fetched := http.get(f"/v1/responses/{queued['id']}").json())["status"] in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the background response never ended"
        assert fetched["status"] == "failed"
        assert fetched["error"] == {"code": "internal_error", "message": "internal server error"}
        monkeypatch.undo()
        assert http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi",
                                                "max_output_tokens": 2}).status_code == 200
    storing.assert_idle_and_clean()
