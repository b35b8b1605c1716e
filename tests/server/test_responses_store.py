"""--enable-responses-store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): stored responses are
returned by GET /v1/responses/{id} and deleted by DELETE, and a request naming one as
``previous_response_id`` answers the whole conversation: transformers' greedy reply to the
chat of the first turn, its answer and the new input (instructions do not carry over)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
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
        response = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hi", "background": True,
                                                    "store": False})
        assert response.status_code == 400 and response.json()["error"]["param"] == "background"
    storing.assert_idle_and_clean()


@pytest.fixture(scope="module")
def slow(tiny_llama: Path) -> Iterator[LiveServer]:
    """A slow engine (each step >= 0.15 s): what a test does after a request's first
    events happens while the request still runs."""
    settings = ServerSettings(served_model_name=SERVED_NAME, enable_responses_store=True)
    live = start_live_server(tiny_llama, settings, step_delay=0.15)
    yield live
    live.stop()


def test_a_cancelled_background_response_stops_its_request(slow: LiveServer) -> None:
    with httpx.Client(base_url=slow.base_url, timeout=60) as http:
        queued = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hello", "background": True,
                                                  "max_output_tokens": 200}).json()
        cancelled = http.post(f"/v1/responses/{queued['id']}/cancel").json()
        assert cancelled["status"] == "cancelled" and cancelled["id"] == queued["id"]
        assert http.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
        slow.assert_idle_and_clean()  # its engine request was aborted, its blocks freed
        # Deleted while it runs, it stops too, and nothing of it is stored again.
        queued = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "hello", "background": True,
                                                  "max_output_tokens": 200}).json()
        assert http.delete(f"/v1/responses/{queued['id']}").json()["deleted"] is True
        slow.assert_idle_and_clean()
        assert http.get(f"/v1/responses/{queued['id']}").status_code == 404


def sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


def test_a_streamed_background_response_goes_on_without_its_client_and_streams_again(
        slow: LiveServer, storing: LiveServer) -> None:
    """The client reads the first three events and leaves; the response is generated to
    its end all the same, and a GET with stream=true gives the events after any
    sequence_number, the same each time, ending as the stored response does (the same
    model's answer without background, from the server without a step delay)."""
    body = {"model": SERVED_NAME, "input": "hello there", "max_output_tokens": 20, "temperature": 0.0}
    with httpx.Client(base_url=slow.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json={**body, "background": True, "stream": True}) as first:
            lines = first.iter_lines()
            head: list[dict[str, Any]] = []
            while len(head) < 3:
                head += sse_events(iter([next(lines)]))
        response_id = head[0]["response"]["id"]
        assert [e["type"] for e in head] == ["response.created", "response.in_progress",
                                             "response.output_item.added"]
        assert head[0]["response"]["status"] == "queued" and head[1]["response"]["status"] == "in_progress"
        assert http.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress"  # ~2.8 s of steps to go
        with http.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 2}) as rest:
            tail = sse_events(rest.iter_lines())
        assert [e["sequence_number"] for e in tail] == list(range(3, 3 + len(tail)))
        assert tail[-1]["type"] == "response.incomplete"  # its 20 tokens, all generated
        stored = http.get(f"/v1/responses/{response_id}").json()
        assert tail[-1]["response"] == stored and stored["usage"]["output_tokens"] == 20
        plain = httpx.post(f"{storing.base_url}/v1/responses", json=body, timeout=60).json()
        assert stored["output"][0]["content"] == plain["output"][0]["content"]
        with http.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as again:
            whole = sse_events(again.iter_lines())
        assert whole[:3] == head and whole[3:] == tail
        with http.stream("GET", f"/v1/responses/{response_id}",
                         params={"stream": "true", "starting_after": whole[-1]["sequence_number"]}) as none:
            assert sse_events(none.iter_lines()) == []
        # What cannot be streamed again is a 400 naming the field; an unknown id a 404.
        for params, param in (({"stream": "true", "starting_after": -1}, "starting_after"),
                              ({"starting_after": 2}, "starting_after")):
            refused = http.get(f"/v1/responses/{response_id}", params=params)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        refused = httpx.get(f"{storing.base_url}/v1/responses/{plain['id']}", params={"stream": "true"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
        assert http.get("/v1/responses/resp_unknown", params={"stream": "true"}).status_code == 404
    slow.assert_idle_and_clean()


def test_event_logs_are_followed_from_any_point_and_only_ended_ones_are_forgotten() -> None:
    from kvloom.server.response_store import ResponseStore

    async def scenario() -> None:
        store = ResponseStore(capacity=4, log_capacity=2)
        running = store.new_log("r0")
        late = asyncio.ensure_future(_read(running.follow(1)))
        for event in ("e0", "e1", "e2"):
            running.append(event)
            await asyncio.sleep(0)  # the reader's turn: it must not miss an event appended while it waits
        assert not late.done()
        running.end()
        assert await late == ["e1", "e2"] and await _read(running.follow(0)) == ["e0", "e1", "e2"]
        unended = store.new_log("r1")
        for rid in ("r2", "r3"):
            store.new_log(rid).end()
        # Over capacity: the oldest ended ones go (r0, then r2), never the running r1.
        assert store.log("r0") is None and store.log("r1") is unended and store.log("r2") is None
        assert store.log("r3") is not None
        store.put({"id": "r3", "output": []}, [])
        assert store.delete("r3") and store.log("r3") is None

    asyncio.run(scenario())


async def _read(events: AsyncIterator[str]) -> list[str]:
    return [event async for event in events]


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
