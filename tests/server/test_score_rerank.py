"""vLLM's Score and Rerank APIs on the tiny model as a bi-encoder: each score is the
cosine of the two texts' embeddings, each embedding transformers' normalized last hidden
state of the text's last token; texts pair 1:1, 1:N or N:N; rerank sorts by that score
and keeps top_n; what a bi-encoder cannot honour is a 400 naming the field. Also
``LLM.score`` offline."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from server_harness import SERVED_NAME, LiveServer

transformers = pytest.importorskip("transformers")

QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "the quick brown fox", "an unrelated sentence about tea", "fox"]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def embedding(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=-1)


def tokens(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def expected(http: httpx.Client, reference: torch.nn.Module, first: str, second: str) -> float:
    a, b = (embedding(reference, tokens(http, text)) for text in (first, second))
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("path, fields", [
    ("/score", ("text_1", "text_2")), ("/v1/score", ("queries", "documents")), ("/score", ("queries", "items")),
    ("/score", ("data_1", "data_2"))])
def test_one_against_many_is_the_cosine_of_transformers_embeddings(http: httpx.Client, live_server: LiveServer,
                                                                   reference: torch.nn.Module, path: str,
                                                                   fields: tuple[str, str]) -> None:
    reply = http.post(path, json={"model": SERVED_NAME, fields[0]: QUERY, fields[1]: DOCS})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "list" and data["model"] == SERVED_NAME
    assert [item["index"] for item in data["data"]] == [0, 1, 2, 3]
    for item, doc in zip(data["data"], DOCS, strict=True):
        assert item["object"] == "score" and item["score"] == pytest.approx(expected(http, reference, QUERY, doc),
                                                                            abs=1e-5)
    assert data["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)  # the query itself
    # The query is embedded once: its tokens and each document's.
    count = len(tokens(http, QUERY)) + sum(len(tokens(http, doc)) for doc in DOCS)
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] == count
    live_server.assert_idle_and_clean()


def test_pairs_element_by_element_and_refuses_other_shapes(http: httpx.Client, live_server: LiveServer,
                                                          reference: torch.nn.Module) -> None:
    firsts, seconds = ["a b c", "tea time"], ["d e f", "tea time"]
    data = http.post("/score", json={"text_1": firsts, "text_2": seconds}).json()["data"]
    for item, first, second in zip(data, firsts, seconds, strict=True):
        assert item["score"] == pytest.approx(expected(http, reference, first, second), abs=1e-5)
    for body, param in (({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                        ({"text_1": "a", "text_2": []}, "text_2"),
                        ({"text_1": "a", "documents": ["b"]}, None),
                        ({"text_1": "a", "text_2": ["b"], "data_1": "c", "data_2": "d"}, None),
                        ({"text_1": "a", "text_2": [""]}, "text_2"),
                        ({"text_1": "a", "text_2": "b", "instruction": "judge"}, "instruction"),
                        ({"text_1": "a", "text_2": "b", "max_tokens_per_doc": 256}, "max_tokens_per_doc"),
                        ({"text_1": "a", "text_2": [[1, 2]]}, None)):
        refused = http.post("/score", json=body)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["error"]["param"] == param or param is None, refused.text
    live_server.assert_idle_and_clean()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_the_score_and_keeps_top_n(http: httpx.Client, live_server: LiveServer,
                                                  reference: torch.nn.Module, path: str) -> None:
    scores = [expected(http, reference, QUERY, doc) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    whole = http.post(path, json={"model": SERVED_NAME, "query": QUERY, "documents": DOCS}).json()
    assert [r["index"] for r in whole["results"]] == order
    for result in whole["results"]:
        assert result["document"] == {"text": DOCS[result["index"]], "multi_modal": None}
        assert result["relevance_score"] == pytest.approx(scores[result["index"]], abs=1e-5)
    top = http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2, "request_id": "r7"}).json()
    assert [r["index"] for r in top["results"]] == order[:2] and top["id"] == "rerank-r7"
    assert top["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    live_server.assert_idle_and_clean()


def test_documents_cut_to_max_tokens_per_doc_score_as_the_cut_text(http: httpx.Client, live_server: LiveServer,
                                                                    reference: torch.nn.Module) -> None:
    long_doc = "jumps over the lazy dog and then runs far away into the woods"
    reply = http.post("/rerank", json={"query": QUERY, "documents": [long_doc], "max_tokens_per_doc": 3}).json()
    # The cut text: the document's first three tokens, as the tokenizer splits it alone.
    first_three = http.post("/detokenize", json={"tokens": tokens(http, long_doc)[:3]}).json()["prompt"]
    bos = len(tokens(http, "a")) - len(http.post("/tokenize", json={"prompt": "a", "add_special_tokens": False})
                                        .json()["tokens"])
    assert reply["usage"]["prompt_tokens"] == len(tokens(http, QUERY)) + 3 + bos
    assert reply["results"][0]["relevance_score"] == pytest.approx(expected(http, reference, QUERY, first_three),
                                                                   abs=1e-5)
    live_server.assert_idle_and_clean()


def test_llm_score_pairs_as_the_server_does(tiny_llama: Path, reference: torch.nn.Module) -> None:
    from kvloom import LLM
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    outputs = llm.score(QUERY, DOCS)
    assert len(outputs) == len(DOCS)
    query_ids = llm.tokenizer.encode(QUERY)
    for output, doc in zip(outputs, DOCS, strict=True):
        doc_ids = llm.tokenizer.encode(doc)
        want = torch.nn.functional.cosine_similarity(embedding(reference, query_ids), embedding(reference, doc_ids),
                                                     dim=0)
        assert output.outputs.score == pytest.approx(float(want), abs=1e-5)
        assert output.prompt_token_ids == query_ids + doc_ids
    with pytest.raises(ValueError, match="pair 1:1, 1:N or N:N; got 2 and 3"):
        llm.score(["a", "b"], ["c", "d", "e"])
    # vLLM's truncate_prompt_tokens: each text's last k tokens, as transformers embeds them.
    [cut] = llm.score(DOCS[0], DOCS[2], truncate_prompt_tokens=3)
    first, second = (llm.tokenizer.encode(text)[-3:] for text in (DOCS[0], DOCS[2]))
    assert cut.prompt_token_ids == first + second
    assert cut.outputs.score == pytest.approx(float(torch.nn.functional.cosine_similarity(
        embedding(reference, first), embedding(reference, second), dim=0)), abs=1e-5)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be in"):
        llm.embed(["a"], truncate_prompt_tokens=0)
    llm.engine.check_integrity()
