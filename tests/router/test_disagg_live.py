"""A live prefill instance and a live decode instance (tiny model, threads on loopback)
behind a live router: what a client gets, whole and streamed, chat and completions,
is what one --role both instance answers, and the KV really moved."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import samples, start_worker

from kvloom.router.config import RouterConfig
from kvloom.router.main import BackgroundRouter, start_background_router
from kvloom.server.background import BackgroundServer

BODY = {"prompt": "Once upon a time, in a land far away, there lived a curious fox who",
        "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Tell me about the fox and the quiet river."}],
        "max_tokens": 10, "temperature": 0.0}


@pytest.fixture(scope="module")
def instances(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackgroundServer]]:
    shm = str(tmp_path_factory.mktemp("kv-shm"))
    live = {"single": start_worker(tiny_llama),
            "prefill": start_worker(tiny_llama, role="prefill", kv_shm_dir=shm),
            "decode": start_worker(tiny_llama, role="decode", kv_shm_dir=shm)}
    yield live
    for server in live.values():
        server.stop()


@pytest.fixture(scope="module")
def router(instances: dict[str, BackgroundServer]) -> Iterator[BackgroundRouter]:
    live = start_background_router(RouterConfig((), prefill=(instances["prefill"].base_url,),
                                                decode=(instances["decode"].base_url,),
                                                health_interval=0.2, startup_timeout=30.0))
    yield live
    live.stop()


def streamed_text(client: httpx.Client, path: str, body: dict[str, Any]) -> str:
    text = ""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices:
                    text += choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
    return text


def test_the_pair_answers_what_one_instance_answers(instances: dict[str, BackgroundServer],
                                                    router: BackgroundRouter) -> None:
    with httpx.Client(base_url=instances["single"].base_url, timeout=60) as single, \
            httpx.Client(base_url=router.base_url, timeout=60) as pair:
        for path, body, field in (("/v1/completions", BODY, "text"), ("/v1/chat/completions", CHAT, "message")):
            want = single.post(path, json=body).json()["choices"][0]
            got = pair.post(path, json=body)
            assert got.status_code == 200, got.text
            assert got.headers["x-kvloom-worker"] == instances["decode"].base_url
            assert got.json()["choices"][0][field] == want[field]
            text = want[field] if field == "text" else want[field]["content"]
            assert streamed_text(pair, path, body) == text
    metrics = samples(httpx.get(f"{instances['decode'].base_url}/metrics").text)
    assert metrics[("kvloom:kv_transfer_imports_total", ())] == 4
    assert metrics[("kvloom:kv_transfer_import_failures_total", ())] == 0
    staged = samples(httpx.get(f"{instances['prefill'].base_url}/metrics").text)
    assert staged[("kvloom:kv_transfer_staged_total", ())] == 4
    for name in ("prefill", "decode"):
        instances[name].assert_idle_and_clean()


def through_both_legs(instances: dict[str, BackgroundServer], router: BackgroundRouter, path: str,
                      body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``body`` to ``path`` on the single instance and through the router's pair: both
    answers, after checking that the decode instance answered and imported the prompt's
    KV once, and that neither instance holds a block afterwards."""
    imports = ("kvloom:kv_transfer_imports_total", ())
    before = samples(httpx.get(f"{instances['decode'].base_url}/metrics").text)[imports]
    with httpx.Client(base_url=instances["single"].base_url, timeout=60) as single, \
            httpx.Client(base_url=router.base_url, timeout=60) as pair:
        want = single.post(path, json=body).json()
        got = pair.post(path, json=body)
        assert got.status_code == 200, got.text
        assert got.headers["x-kvloom-worker"] == instances["decode"].base_url
    assert samples(httpx.get(f"{instances['decode'].base_url}/metrics").text)[imports] == before + 1
    for name in ("prefill", "decode"):
        instances[name].assert_idle_and_clean()
    return want, got.json()


def test_a_responses_request_goes_through_both_legs(instances: dict[str, BackgroundServer],
                                                    router: BackgroundRouter) -> None:
    body = {"input": "Tell me about the fox and the quiet river.", "max_output_tokens": 10, "temperature": 0.0}
    want, got = through_both_legs(instances, router, "/v1/responses", body)
    assert got["output"][0]["content"] == want["output"][0]["content"]


def test_an_anthropic_messages_request_goes_through_both_legs(instances: dict[str, BackgroundServer],
                                                              router: BackgroundRouter) -> None:
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about the fox and the quiet river."}]}
    want, got = through_both_legs(instances, router, "/v1/messages", body)
    assert got["content"] == want["content"] and got["stop_reason"] == want["stop_reason"]
