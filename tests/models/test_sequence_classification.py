"""Sequence classifiers (``LlamaForSequenceClassification``, ``Qwen2...``, ``Qwen3...``):
the causal decoder with a score head read at the input's last token. Class
probabilities are held to transformers' own classifier (its logits through a softmax,
or a sigmoid for one label or a multi-label model), a cross-encoder's pair scores to
transformers' logit for the tokenizer's pair of texts; the default dtype's exactness
(a prompt alone equals it batched, chunked and after a prefix hit), two ranks, and
what such a model refuses (generation, vocabulary knobs) without losing a block."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_models import write_tiny_hf_model

from kvloom import LLM, SamplingParams
from kvloom.config import ModelConfig
from kvloom.models.registry import UnsupportedArchitecture, build_model

transformers = pytest.importorskip("transformers")

RNG = random.Random(11)
SHARED = [RNG.randrange(3, 500) for _ in range(40)]
# Token 0 is the models' pad token, which transformers' classifier skips: never in a prompt.
PROMPTS = [SHARED + [RNG.randrange(3, 500) for _ in range(n)] for n in (2, 19)]
PROMPTS += [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 7, 33, 70)]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def llama_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("llama_cls"), arch="llama_classifier", id2label=LABELS,
                               label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def qwen3_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 and block 16: the native walk's paired KV layout; one label: a cross-encoder.
    return write_tiny_hf_model(tmp_path_factory.mktemp("qwen3_ce"), arch="qwen3_classifier", num_labels=1,
                               hidden_size=128, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64)


def reference_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([prompt])).logits[0] for prompt in prompts]


def test_probabilities_and_labels_equal_transformers_softmax(llama_classifier: Path) -> None:
    llm = LLM(str(llama_classifier), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=32)
    config = llm.engine.model_config
    assert config.architecture == "LlamaForCausalLM" and config.classifier is not None
    assert config.classifier.labels == ("negative", "neutral", "positive")
    outputs = llm.classify(PROMPTS)  # chunked: 32 tokens a step; the second prompt hits the first's prefix
    for output, prompt, logits in zip(outputs, PROMPTS, reference_logits(llama_classifier, PROMPTS), strict=True):
        assert output.prompt_token_ids == prompt and output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.softmax(-1), atol=1e-6), prompt
    assert outputs[1].num_cached_tokens >= 32
    assert llm.engine.kv_manager.num_available_blocks == 64


def test_a_multi_label_model_takes_each_class_sigmoid(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path, arch="qwen2_classifier", id2label=LABELS, seed=3,
                               problem_type="multi_label_classification")
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64)
    for output, logits in zip(llm.classify(PROMPTS[:3]), reference_logits(path, PROMPTS[:3]), strict=True):
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.sigmoid(), atol=1e-6)


def test_bf16_class_logits_alone_equal_batched_chunked_and_after_a_prefix_hit(qwen3_cross_encoder: Path) -> None:
    """Each input's logits in the default dtype do not depend on what ran beside it."""
    classify = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling="classify")
    alone = []
    for prompt in PROMPTS:
        llm = LLM(str(qwen3_cross_encoder), dtype="bfloat16", block_size=16, num_blocks=64,
                  enable_prefix_caching=False)
        alone.append(llm.generate([prompt], classify)[0].pooled)
    together = LLM(str(qwen3_cross_encoder), dtype="bfloat16", block_size=16, num_blocks=64,
                   max_num_batched_tokens=24)
    assert together.engine.model.native_stack is not None  # the native walk ran (its per-head norms included)
    assert [output.pooled for output in together.generate(PROMPTS, classify)] == alone
    assert [output.pooled for output in together.generate(PROMPTS, classify)] == alone  # prefix hits now
    assert together.engine.stats().prefix_cache_hit_tokens >= 32


def test_a_cross_encoder_scores_the_pair_as_transformers_reads_it(qwen3_cross_encoder: Path) -> None:
    """One label: a pair's score is the sigmoid of transformers' logit for
    ``tokenizer(query, document)``, paired 1:N and N:N as vLLM pairs them."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_cross_encoder)
    llm = LLM(str(qwen3_cross_encoder), dtype="float32", block_size=16, num_blocks=64)
    query, documents = "where does the fox sleep", ["the fox sleeps in its den", "a lazy dog", "sleep"]
    pairs = [tokenizer(query, document)["input_ids"] for document in documents]
    expected = [logits.sigmoid().item() for logits in reference_logits(qwen3_cross_encoder, pairs)]
    scored = llm.score(query, documents)
    assert [output.prompt_token_ids for output in scored] == pairs
    assert [output.outputs.score for output in scored] == pytest.approx(expected, abs=1e-6)
    both = llm.score(["where does the fox sleep"] * 3, documents)  # N:N: the same pairs
    assert [output.outputs.score for output in both] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_two_ranks_give_transformers_probabilities(llama_classifier: Path) -> None:
    """The score head is whole on every rank (a handful of rows), after the sharded decoder."""
    with LLM(str(llama_classifier), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = llm.classify(PROMPTS[:3])
    for output, logits in zip(outputs, reference_logits(llama_classifier, PROMPTS[:3]), strict=True):
        assert torch.allclose(torch.tensor(output.outputs.probs), logits.softmax(-1), atol=1e-6)


def test_what_a_classifier_refuses_is_named_and_nothing_is_lost(llama_classifier: Path, tiny_llama: Path) -> None:
    llm = LLM(str(llama_classifier), dtype="float32", block_size=16, num_blocks=64)
    with pytest.raises(ValueError, match="sequence classifier .*it does not generate text"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
    refused = {"max_tokens": r"max_tokens must be 1", "logprobs": r"logprobs is not supported",
               "allowed_token_ids": r"allowed_token_ids is not supported"}
    values = {"max_tokens": 4, "logprobs": 0, "allowed_token_ids": [5]}
    for name, message in refused.items():
        params = SamplingParams(pooling="classify", **{"max_tokens": 1, name: values[name]})
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[:1], params)
    with pytest.raises(ValueError, match="scoring pairs needs a cross-encoder .* has 3 labels"):
        llm.score("a", ["b"])
    expected = [logits.softmax(-1) for logits in reference_logits(llama_classifier, PROMPTS[:2])]
    for output, probs in zip(llm.classify(PROMPTS[:2]), expected, strict=True):  # still serving
        assert torch.allclose(torch.tensor(output.outputs.probs), probs, atol=1e-6)
    assert llm.engine.kv_manager.num_available_blocks == 64
    # An embedding of a classifier is its decoder's last hidden state, normalized, as for any model.
    hidden = transformers.AutoModelForSequenceClassification.from_pretrained(llama_classifier, dtype=torch.float32)
    with torch.no_grad():
        last = hidden(torch.tensor([PROMPTS[2]]), output_hidden_states=True).hidden_states[-1][0, -1]
    embedded = llm.embed([PROMPTS[2]])[0].outputs.embedding
    assert torch.allclose(torch.tensor(embedded), torch.nn.functional.normalize(last, dim=-1), atol=1e-5)
    causal = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=32)
    with pytest.raises(ValueError, match="classify needs a sequence-classification model"):
        causal.classify(PROMPTS[:1])
    with pytest.raises(ValueError, match="pooling 'classify' needs a classification model"):
        causal.generate(PROMPTS[:1], SamplingParams(max_tokens=1, pooling="classify"))
    with pytest.raises(ValueError, match="pooling must be one of embed, classify"):
        SamplingParams(pooling="reward")


def test_a_classifier_of_another_family_is_refused_by_name() -> None:
    """Only the Llama-layered families carry a score head here: another one's classifier
    is refused before any weight is read, naming the families that are served."""
    config = ModelConfig.from_hf({"architectures": ["Qwen2ForSequenceClassification"], "vocab_size": 64,
                                  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_labels": 2})
    assert config.architecture == "Qwen2ForCausalLM" and config.classifier is not None
    assert config.classifier.labels == ("LABEL_0", "LABEL_1") and config.classifier.activation == "softmax"
    mamba = ModelConfig.from_hf({"architectures": ["Mamba2ForSequenceClassification"], "vocab_size": 64,
                                 "hidden_size": 16, "num_hidden_layers": 1, "num_heads": 2, "head_dim": 16,
                                 "state_size": 8, "n_groups": 1, "expand": 2, "id2label": {"0": "a"}})
    with pytest.raises(UnsupportedArchitecture, match=r"Mamba2ForSequenceClassification is not supported.*"
                                                      r"LlamaForCausalLM"):
        build_model(mamba, 64)


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "own_head"])
def test_a_causal_lm_made_a_reranker_from_two_tokens_scores_their_two_way_softmax(tmp_path: Path, tied: bool) -> None:
    """vLLM's ``--hf-overrides`` for the original Qwen3-Reranker: a causal LM read as a
    classifier whose head is the second token's vocabulary row minus the first's, so a
    pair's score is p(second) of the softmax over the two tokens' logits at the pair's
    last token, as transformers' causal LM gives them; with three tokens and no two-way
    rule, the classes are the three tokens and their probabilities a softmax over theirs."""
    path = write_tiny_hf_model(tmp_path, arch="qwen3", tie_word_embeddings=tied, seed=8, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    negative, positive, third = (tokenizer.convert_tokens_to_ids(t) for t in ("Hello", "ques", "io"))
    query, documents = "where does the fox sleep", ["the fox sleeps in its den", "tea", "a lazy dog"]
    pairs = [tokenizer(query, document)["input_ids"] for document in documents]
    with torch.no_grad():
        last = [reference(torch.tensor([ids])).logits[0, -1] for ids in pairs]
    reranker = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Hello", "ques"],
        "is_original_qwen3_reranker": True})
    scores = [output.outputs.score for output in reranker.score(query, documents)]
    expected = [logits[[negative, positive]].softmax(-1)[1].item() for logits in last]
    assert scores == pytest.approx(expected, abs=1e-6)
    # Under two ranks each reads the two rows whole (the tokens sit in either rank's share of the
    # vocabulary) and the embedding's own share of them.
    with LLM(str(path), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2, hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Hello", "ques"],
            "is_original_qwen3_reranker": True}) as split:
        scores = [output.outputs.score for output in split.score(query, documents)]
    assert scores == pytest.approx(expected, abs=1e-5)
    three = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Hello", "ques", "io"]})
    assert three.engine.model_config.classifier.labels == ("Hello", "ques", "io")
    for output, logits in zip(three.classify(pairs), last, strict=True):
        assert torch.allclose(torch.tensor(output.outputs.probs), logits[[negative, positive, third]].softmax(-1),
                              atol=1e-6)


def test_classifier_tokens_the_vocabulary_lacks_are_refused_by_name(tmp_path: Path) -> None:
    path = write_tiny_hf_model(tmp_path, arch="llama")
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["Hello", "yes no"]}
    with pytest.raises(ValueError, match="classifier_from_token: 'yes no' is not one token"):
        LLM(str(path), dtype="float32", block_size=16, num_blocks=16, hf_overrides=overrides)
    config = ModelConfig.from_hf({"architectures": ["LlamaForSequenceClassification"], "vocab_size": 64,
                                  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "classifier_from_token": ["a", "b"],
                                  "method": "from_2_way_softmax"})
    assert config.classifier is not None and config.classifier.num_labels == 1
    with pytest.raises(ValueError, match="two classifier_from_token entries"):
        ModelConfig.from_hf({"architectures": ["LlamaForSequenceClassification"], "vocab_size": 64, "hidden_size": 16,
                             "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "classifier_from_token": ["a", "b", "c"], "is_original_qwen3_reranker": True})


# A score template in the shape of Qwen3-Reranker's (its own words here): the pair as one
# chat turn, with the task's instruction; the reranker reads p("yes") at its end.
SCORE_TEMPLATE = (
    "<|im_start|>system\nSay yes if the document answers the query, else no.<|im_end|>\n<|im_start|>user\n"
    "{%- for message in messages %}{% if message.role == 'query' %}\nTask: {{ instruction or 'find answers' }}"
    "\nQuery: {{ message.content }}{% else %}\nDocument: {{ message.content }}{% endif %}{% endfor %}"
    "<|im_end|>\n<|im_start|>assistant\n")


def test_a_score_template_renders_each_pair_as_transformers_renders_it(tmp_path: Path) -> None:
    """vLLM's score template, the original Qwen3-Reranker's way: each pair rendered by the
    template as the messages [query, document] (with ``instruction``), encoded, and
    scored by the two-way head: transformers' apply_chat_template of the same messages
    and its causal LM's softmax over the two tokens give the same ids and scores."""
    path = write_tiny_hf_model(tmp_path, arch="qwen3", seed=9, hidden_size=128, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = (tokenizer.convert_tokens_to_ids(t) for t in ("Hello", "ques"))
    query, documents = "where does the fox sleep", ["the fox sleeps in its den", "tea"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["Hello", "ques"],
                 "is_original_qwen3_reranker": True}
    reranker = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, hf_overrides=overrides)
    for variables in ({}, {"instruction": "judge relevance"}):
        texts = [tokenizer.apply_chat_template([{"role": "query", "content": query},
                                                {"role": "document", "content": document}],
                                               chat_template=SCORE_TEMPLATE, tokenize=False, **variables)
                 for document in documents]
        pairs = [tokenizer(text)["input_ids"] for text in texts]
        with torch.no_grad():
            expected = [reference(torch.tensor([ids])).logits[0, -1][[no, yes]].softmax(-1)[1].item()
                        for ids in pairs]
        scored = reranker.score(query, documents, chat_template=SCORE_TEMPLATE, chat_template_kwargs=variables)
        assert [output.prompt_token_ids for output in scored] == pairs
        assert [output.outputs.score for output in scored] == pytest.approx(expected, abs=1e-6)
    # An engine started with the template scores through it unasked (vLLM's --chat-template).
    served = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, hf_overrides=overrides,
                 chat_template=SCORE_TEMPLATE)
    assert [o.prompt_token_ids for o in served.score(query, documents)] == [
        tokenizer(tokenizer.apply_chat_template([{"role": "query", "content": query},
                                                 {"role": "document", "content": d}],
                                                chat_template=SCORE_TEMPLATE, tokenize=False))["input_ids"]
        for d in documents]
    with pytest.raises(ValueError, match="chat_template_kwargs are a score template's variables"):
        reranker.score(query, documents, chat_template_kwargs={"instruction": "x"})
