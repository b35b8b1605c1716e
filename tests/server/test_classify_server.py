"""A sequence classifier served: vLLM's ``POST /classify`` (SGLang's ``/v1/classify``)
answers transformers' class probabilities and the most probable class's label; a
classifier of one label is a cross-encoder for ``/score`` and ``/rerank`` (each pair as
``tokenizer(query, document)``, scored by transformers' logit through a sigmoid); what
a classifier cannot do (generate, score with several labels) and ``/classify`` on a
causal LM are 400s naming why, and the engine serves on with no block held."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers_models import write_tiny_hf_model
from server_harness import SERVED_NAME, LiveServer, start_live_server

from kvloom.server.settings import ServerSettings

transformers = pytest.importorskip("transformers")

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["the quick brown fox", "jumps over the lazy dog again", "tea"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("cls"), arch="llama_classifier", id2label=LABELS, seed=5)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("ce"), arch="qwen2_classifier", num_labels=1, seed=6)


def serve(model: Path) -> Iterator[httpx.Client]:
    live = start_live_server(model, ServerSettings(served_model_name=SERVED_NAME))
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            http.live = live  # type: ignore[attr-defined]
            yield http
    finally:
        live.stop()


@pytest.fixture(scope="module")
def classifier_http(classifier: Path) -> Iterator[httpx.Client]:
    yield from serve(classifier)


@pytest.fixture(scope="module")
def cross_encoder_http(cross_encoder: Path) -> Iterator[httpx.Client]:
    yield from serve(cross_encoder)


def logits_of(model: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [reference(torch.tensor([prompt])).logits[0] for prompt in prompts]


def test_classify_answers_transformers_probabilities_and_labels(classifier_http: httpx.Client,
                                                                classifier: Path) -> None:
    ids = [classifier_http.post("/tokenize", json={"prompt": text}).json()["tokens"] for text in TEXTS]
    expected = logits_of(classifier, ids)
    for path, body in (("/classify", {"input": TEXTS}), ("/v1/classify", {"input": ids, "model": SERVED_NAME})):
        reply = classifier_http.post(path, json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "list" and answer["id"].startswith("classify-") and answer["model"] == SERVED_NAME
        assert answer["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                                   "completion_tokens": 0, "prompt_tokens_details": None}
        for index, (item, logits) in enumerate(zip(answer["data"], expected, strict=True)):
            assert item["index"] == index and item["num_classes"] == 3
            assert torch.allclose(torch.tensor(item["probs"]), logits.softmax(-1), atol=1e-6)
            assert item["label"] == LABELS[int(logits.argmax())]
    invoked = classifier_http.post("/invocations", json={"input": TEXTS}).json()  # SageMaker's route: a classify
    direct = classifier_http.post("/classify", json={"input": TEXTS}).json()
    assert invoked["object"] == "list" and invoked["data"] == direct["data"]
    messages = [{"role": "user", "content": TEXTS[1]}]  # a chat: classified as its template renders it
    chat_ids = transformers.AutoTokenizer.from_pretrained(classifier).apply_chat_template(
        messages, tokenize=True, return_dict=True)["input_ids"]
    for path in ("/classify", "/invocations"):
        chat = classifier_http.post(path, json={"messages": messages}).json()
        assert chat["usage"]["prompt_tokens"] == len(chat_ids), chat
        assert torch.allclose(torch.tensor(chat["data"][0]["probs"]), logits_of(classifier, [chat_ids])[0].softmax(-1),
                              atol=1e-6)
    raw = classifier_http.post("/classify", json={"input": TEXTS[0], "use_activation": False,
                                                  "request_id": "r1"}).json()
    assert raw["id"] == "classify-r1"
    assert torch.allclose(torch.tensor(raw["data"][0]["probs"]), expected[0], atol=1e-5)  # the logits themselves
    classifier_http.live.assert_idle_and_clean()  # type: ignore[attr-defined]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, None, "sequence classifier .*does not generate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None, "does not generate"),
    ("/score", {"text_1": "a", "text_2": "b"}, "model", "cross-encoder .*has 3 labels"),
    ("/classify", {"input": []}, "input", "must not be empty"),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens", r"must be in \[1, 256\]"),
])
def test_what_a_classifier_cannot_do_is_a_400_naming_it(classifier_http: httpx.Client, path: str, body: dict,
                                                        param: str | None, message: str) -> None:
    reply = classifier_http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert classifier_http.post("/classify", json={"input": "still serving"}).status_code == 200
    classifier_http.live.assert_idle_and_clean()  # type: ignore[attr-defined]


def test_a_cross_encoder_scores_and_reranks_pairs_as_transformers(cross_encoder_http: httpx.Client,
                                                                  cross_encoder: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    query, documents = "where does the fox sleep", ["a lazy dog", "the fox sleeps in its den", "tea"]
    pairs = [tokenizer(query, document)["input_ids"] for document in documents]
    logits = [value.item() for value in torch.cat(logits_of(cross_encoder, pairs))]
    expected = torch.tensor(logits).sigmoid().tolist()
    scored = cross_encoder_http.post("/score", json={"text_1": query, "text_2": documents}).json()
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-6)
    assert scored["usage"]["prompt_tokens"] == sum(map(len, pairs))
    raw = cross_encoder_http.post("/v1/score", json={"queries": [query] * 3, "documents": documents,
                                                     "use_activation": False}).json()
    assert [item["score"] for item in raw["data"]] == pytest.approx(logits, abs=1e-5)
    ranked = cross_encoder_http.post("/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [item["index"] for item in ranked["results"]] == best
    assert [item["relevance_score"] for item in ranked["results"]] == pytest.approx([expected[i] for i in best],
                                                                                      abs=1e-6)
    reply = cross_encoder_http.post("/score", json={"text_1": query, "text_2": "x", "instruction": "judge"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "instruction"
    assert "cross-encoder" in reply.json()["error"]["message"]
    cross_encoder_http.live.assert_idle_and_clean()  # type: ignore[attr-defined]


def test_classify_on_a_causal_lm_is_a_400(http: httpx.Client, live_server: LiveServer) -> None:
    reply = http.post("/classify", json={"input": "hello"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    assert "sequence-classification model" in reply.json()["error"]["message"]
    # /pooling on a causal LM: every token's normalized state by default; no classify tasks.
    ids = http.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    vectors = http.post("/pooling", json={"input": "hello there"}).json()["data"][0]["data"]
    assert len(vectors) == len(ids) and all(abs(sum(v * v for v in row) - 1) < 1e-4 for row in vectors)
    refused = http.post("/pooling", json={"input": "hello", "task": "token_classify"})
    assert refused.status_code == 400 and "needs a classification model" in refused.json()["error"]["message"]
    live_server.assert_idle_and_clean()


def test_a_cross_encoder_served_with_a_score_template_reads_each_pair_through_it(cross_encoder: Path) -> None:
    """vLLM's score template: a cross-encoder served with --chat-template renders each
    /score and /rerank pair as the messages [query, document] with chat_template_kwargs
    (``instruction`` folded in, an explicit key winning), as transformers'
    apply_chat_template renders them, and scores them as transformers' classifier; a
    template that refuses the pair, or a reserved variable, is a 400."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if instruction %}({{ instruction }}){% endif %}"
                "{% if instruction == 'refuse' %}{{ raise_exception('no pairs today') }}{% endif %}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    query, documents = "where does the fox sleep", ["a lazy dog", "the fox sleeps in its den"]

    def expected(**variables: str) -> list[float]:
        pairs = [tokenizer(tokenizer.apply_chat_template(
            [{"role": "query", "content": query}, {"role": "document", "content": document}],
            chat_template=template, tokenize=False, **variables))["input_ids"] for document in documents]
        return torch.cat(logits_of(cross_encoder, pairs)).sigmoid().tolist()

    live = start_live_server(cross_encoder, ServerSettings(served_model_name=SERVED_NAME), chat_template=template)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            plain = http.post("/score", json={"text_1": query, "text_2": documents}).json()
            assert [item["score"] for item in plain["data"]] == pytest.approx(expected(), abs=1e-6)
            ranked = http.post("/rerank", json={"query": query, "documents": documents, "instruction": "judge",
                                                "chat_template_kwargs": {"instruction": "rank"}}).json()
            scores = expected(instruction="rank")
            by_index = {item["index"]: item["relevance_score"] for item in ranked["results"]}
            assert [by_index[index] for index in range(len(documents))] == pytest.approx(scores, abs=1e-6)
            for body, param, message in (
                    ({"instruction": "refuse"}, "chat_template_kwargs", "no pairs today"),
                    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
                    ({"padding": "max_length"}, "padding", "not supported")):
                reply = http.post("/score", json={"text_1": query, "text_2": documents, **body})
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["param"] == param and message in error["message"], error
            live.assert_idle_and_clean()
    finally:
        live.stop()


def test_the_pooling_route_answers_every_task_as_transformers(tmp_path: Path) -> None:
    """vLLM's POST /pooling on a token classifier: by default each token's class
    probabilities (transformers' ``logits.softmax(-1)``), "token_embed" each token's
    normalized state, "embed" the last token's (base64 as /v1/embeddings sends it); a
    task the model cannot do is a 400 naming ``task``, and nothing is held after."""
    import base64
    import struct

    labels = {0: "O", 1: "B-LOC", 2: "I-LOC"}
    model = write_tiny_hf_model(tmp_path, arch="llama_token_classifier", id2label=labels, seed=12)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    reference = transformers.AutoModelForTokenClassification.from_pretrained(model, dtype=torch.float32).eval()
    texts = ["the fox sleeps in Oslo", "tea"]
    with torch.no_grad():
        runs = [reference(torch.tensor([tokenizer(text)["input_ids"]]), output_hidden_states=True) for text in texts]
    live = start_live_server(model, ServerSettings(served_model_name=SERVED_NAME))
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            reply = http.post("/pooling", json={"input": texts}).json()
            assert reply["object"] == "list" and [item["object"] for item in reply["data"]] == ["pooling"] * 2
            for item, run in zip(reply["data"], runs, strict=True):
                assert torch.allclose(torch.tensor(item["data"]), run.logits[0].softmax(-1), atol=1e-6)
            states = [torch.nn.functional.normalize(run.hidden_states[-1][0], dim=-1) for run in runs]
            token_embed = http.post("/pooling", json={"input": texts, "task": "token_embed"}).json()
            for item, want in zip(token_embed["data"], states, strict=True):
                assert torch.allclose(torch.tensor(item["data"]), want, atol=1e-5)
            embed = http.post("/pooling", json={"input": texts[0], "task": "embed", "encoding_format": "base64"})
            raw = base64.b64decode(embed.json()["data"][0]["data"])
            assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), states[0][-1], atol=1e-5)
            assert embed.json()["usage"]["prompt_tokens"] == len(tokenizer(texts[0])["input_ids"])
            for body, message in (({"input": "x", "task": "classify"}, "token classifier"),
                                  ({"input": "x", "task": "reward"}, "task must be one of")):
                refused = http.post("/pooling", json=body)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "task", refused.text
                assert message in refused.json()["error"]["message"]
            live.assert_idle_and_clean()
    finally:
        live.stop()
