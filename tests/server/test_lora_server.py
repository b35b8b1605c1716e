"""LoRA over HTTP (vLLM's --enable-lora --lora-modules name=path): a request's "model"
names an adapter; replies are PEFT's greedy tokens with that adapter, the base model's
without; /v1/models lists the adapters under the served model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers_lora import greedy_tokens, reference_model, write_adapter
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    return {"sql": write_adapter(tiny_llama, root / "sql", 5, 4, ["q_proj", "v_proj", "down_proj"]),
            "poet": write_adapter(tiny_llama, root / "poet", 6, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"])}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_name=SERVED_NAME,
                              lora_modules=tuple((name, str(path)) for name, path in adapters.items()))
    live = start_live_server(tiny_llama, settings, enable_lora=True, max_loras=2)
    yield live
    live.stop()


def test_each_model_name_serves_its_adapter(server: LiveServer, tiny_llama: Path, adapters: dict[str, Path]) -> None:
    prompt = [11, 45, 230, 7, 99, 12, 3, 64, 18]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(SERVED_NAME, None), ("sql", SERVED_NAME),
                                                             ("poet", SERVED_NAME)]
        assert models[1]["root"] == str(adapters["sql"])
        texts = {}
        for name in (SERVED_NAME, "sql", "poet"):
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            response = http.post("/v1/completions", json=body).json()
            assert response["model"] == name
            reference = reference_model(tiny_llama, None if name == SERVED_NAME else adapters[name])
            expected = http.post("/detokenize", json={"tokens": greedy_tokens(reference, prompt, 8)}).json()["prompt"]
            assert response["choices"][0]["text"] == expected
            texts[name] = expected
        assert len(set(texts.values())) == 3
        # Chat: the prompt the template makes, under the adapter.
        messages = [{"role": "user", "content": "hello there"}]
        chat = http.post("/v1/chat/completions", json={"model": "poet", "messages": messages, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}).json()
        tokens = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()["tokens"]
        expected = greedy_tokens(reference_model(tiny_llama, adapters["poet"]), tokens, 6)
        assert chat["model"] == "poet"
        assert chat["choices"][0]["message"]["content"] == \
            http.post("/detokenize", json={"tokens": expected}).json()["prompt"]
        missing = http.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == (f"The model 'nope' does not exist; this server serves "
                                                      f"'{SERVED_NAME}', 'sql', 'poet'")
    server.assert_idle_and_clean()


def test_lora_module_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"lora_modules names must be unique, got \['a', 'a'\]"):
        ServerSettings(lora_modules=(("a", "/x"), ("a", "/y")))
    with pytest.raises(ValueError, match="lora_path must be a non-empty string"):
        ServerSettings(lora_modules=(("a", ""),))


@pytest.fixture(scope="module")
def updating_server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    settings = ServerSettings(served_model_name=SERVED_NAME, allow_runtime_lora_updating=True)
    live = start_live_server(tiny_llama, settings, enable_lora=True, max_loras=1)
    yield live
    live.stop()


def test_adapters_load_and_unload_at_run_time(updating_server: LiveServer, tiny_llama: Path,
                                              adapters: dict[str, Path]) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (behind its runtime-updating
    switch): a loaded name serves its adapter, an unloaded one is a 404, and a name can
    be loaded again from another path."""
    prompt = [11, 45, 230, 7, 99, 12, 3, 64, 18]

    def completion(http: httpx.Client, model: str) -> httpx.Response:
        return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True})

    def expected(http: httpx.Client, adapter: Path) -> str:
        tokens = greedy_tokens(reference_model(tiny_llama, adapter), prompt, 6)
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

    with httpx.Client(base_url=updating_server.base_url, timeout=60) as http:
        assert completion(http, "poet").status_code == 404
        load = http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])})
        assert load.status_code == 200, load.text
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [SERVED_NAME, "poet"]
        assert completion(http, "poet").json()["choices"][0]["text"] == expected(http, adapters["poet"])
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["sql"])})
        assert again.status_code == 400
        assert again.json()["error"]["message"] == "The LoRA adapter 'poet' has already been loaded."
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/adapter"})
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
        base = http.post("/v1/load_lora_adapter", json={"lora_name": SERVED_NAME, "lora_path": str(adapters["sql"])})
        assert base.status_code == 400 and "is the served model's name" in base.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
        assert completion(http, "poet").status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "The LoRA adapter 'poet' cannot be found."
        # The name again, now for the other adapter (and the one slot reused).
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "poet",
                                                        "lora_path": str(adapters["sql"])}).status_code == 200
        assert completion(http, "poet").json()["choices"][0]["text"] == expected(http, adapters["sql"])
    updating_server.assert_idle_and_clean()


def test_run_time_updating_is_off_unless_allowed(server: LiveServer, adapters: dict[str, Path]) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["sql"])})
        assert response.status_code == 404


def test_metrics_name_the_running_adapters(tiny_llama: Path, adapters: dict[str, Path]) -> None:
    """vLLM's lora_requests_info: while a request on "sql" streams, the running adapters
    are "sql"; once it ends, none. (A slow engine: 50 tokens take >= 1 s.)"""
    settings = ServerSettings(served_model_name=SERVED_NAME, lora_modules=(("sql", str(adapters["sql"])),))
    live = start_live_server(tiny_llama, settings, step_delay=0.02, enable_lora=True, max_loras=3)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            body = {"model": "sql", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as stream:
                events = stream.iter_lines()
                next(events)  # the request is running
                metrics = http.get("/metrics").text
                assert ('kvloom:lora_requests_info{max_lora="3",running_lora_adapters="sql",'
                        'waiting_lora_adapters=""}') in metrics
                for _ in events:
                    pass
            live.assert_idle_and_clean()
            metrics = http.get("/metrics").text
            lines = [line for line in metrics.splitlines() if line.startswith("kvloom:lora_requests_info{")]
            assert len(lines) == 1
            assert lines[0].startswith('kvloom:lora_requests_info{max_lora="3",running_lora_adapters="",'
                                       'waiting_lora_adapters=""}')
    finally:
        live.stop()
