"""vLLM's token pooling tasks (``LLM.encode``): "token_embed", every prompt token's final
hidden state L2-normalized, held to transformers' decoder (its ``last_hidden_state``);
"token_classify", a token classifier's (``LlamaForTokenClassification``,
``Qwen3ForTokenClassification``) class probabilities at every token, held to transformers'
own classifier. A prompt computed in chunks, after a prefix-cache hit on the same
prompt (none is taken: every token is computed) and beside generating requests gives
every position; what a token task cannot be is refused by name, nothing lost."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_models import write_tiny_hf_model

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

RNG = random.Random(5)
# Token 0 is the models' pad token: never in a prompt.
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 9, 40, 75)]
LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}


@pytest.fixture(scope="module")
def token_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("llama_tok"), arch="llama_token_classifier", id2label=LABELS,
                               label2id={v: k for k, v in LABELS.items()}, seed=4)


def test_token_embed_is_every_tokens_normalized_state_as_transformers_computes_it(tiny_llama: Path) -> None:
    """float32, chunks of 16 tokens: each prompt's [tokens, hidden] vectors are
    transformers' last_hidden_state, normalized per token; the same prompt again (its
    blocks cached) and beside a generating request gives the same vectors."""
    reference = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [torch.nn.functional.normalize(reference(torch.tensor([p])).last_hidden_state[0], dim=-1)
                    for p in PROMPTS]
    llm = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16)
    encoded = llm.encode(PROMPTS, pooling_task="token_embed")
    for output, want, prompt in zip(encoded, expected, PROMPTS, strict=True):
        assert output.prompt_token_ids == prompt and output.outputs.data.shape == want.shape
        assert torch.allclose(output.outputs.data, want, atol=1e-5)
    llm.generate(PROMPTS[2:3], SamplingParams(max_tokens=2))  # its blocks now in the prefix cache
    again = llm.encode(PROMPTS[2:3])[0]  # the default task of a causal LM
    assert again.num_cached_tokens == 0 and torch.equal(again.outputs.data, encoded[2].outputs.data)
    mixed = llm.generate([PROMPTS[3], PROMPTS[1]], [SamplingParams(max_tokens=8),
                                                  SamplingParams(max_tokens=1, pooling="token_embed")])
    assert torch.equal(torch.tensor(mixed[1].pooled), encoded[1].outputs.data)
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_available_blocks == 64  # cached blocks are free to evict


def test_a_token_classifier_gives_each_tokens_probabilities_as_transformers(token_classifier: Path) -> None:
    """Every token's softmax over the classes, transformers' ``logits.softmax(-1)`` (the
    head has a bias, as transformers builds it); raw logits with use_activation False;
    bf16 vectors of a prompt alone equal it batched and chunked (the kernels are
    batch-invariant)."""
    reference = transformers.AutoModelForTokenClassification.from_pretrained(token_classifier,
                                                                             dtype=torch.float32).eval()
    assert reference.score.bias is not None
    with torch.no_grad():
        logits = [reference(torch.tensor([p])).logits[0] for p in PROMPTS]
    llm = LLM(str(token_classifier), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.model_config.classifier.per_token
    for output, want in zip(llm.encode(PROMPTS), logits, strict=True):  # token_classify: the default
        assert torch.allclose(output.outputs.data, want.softmax(-1), atol=1e-6)
    raw = llm.encode(PROMPTS[2:3], pooling_task="token_classify", use_activation=False)[0].outputs.data
    assert torch.allclose(raw, logits[2], atol=1e-5)
    bf16 = LLM(str(token_classifier), dtype="bfloat16", block_size=16, num_blocks=64, max_num_batched_tokens=24)
    alone = [bf16.encode([p], use_activation=False)[0].outputs.data for p in PROMPTS]
    together = [o.outputs.data for o in bf16.encode(PROMPTS, use_activation=False)]
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def test_what_token_pooling_refuses_is_named_and_nothing_is_lost(token_classifier: Path, tiny_llama: Path) -> None:
    llm = LLM(str(token_classifier), dtype="float32", block_size=16, num_blocks=64)
    with pytest.raises(ValueError, match="token classifier: it classifies each token"):
        llm.classify(PROMPTS[:1])
    with pytest.raises(ValueError, match="token classifier .* it does not generate text"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens must be 1 for pooling 'token_embed'"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, pooling="token_embed"))
    causal = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=32)
    with pytest.raises(ValueError, match="pooling 'token_classify' needs a classification model"):
        causal.encode(PROMPTS[:1], pooling_task="token_classify")
    assert len(llm.encode(PROMPTS[:2])) == 2  # still serving
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_available_blocks == 64  # cached blocks are free to evict


def test_a_prompt_recomputed_after_preemption_keeps_each_position_once(tiny_llama: Path) -> None:
    """The output processor's rule: chunks that overlap the positions kept (a preempted
    prompt computed again from its start) add only the positions it lacks, and the
    vectors are complete at the prompt's end; a gap is a bug, raised."""
    from kvloom.batch import TokenPooled
    from kvloom.engine.output_processor import OutputProcessor
    from kvloom.request import Request
    from kvloom.tokenizer import Tokenizer

    processor = OutputProcessor(Tokenizer.from_file(tiny_llama / "tokenizer.json"))
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, pooling="token_embed"), (2,), 64)
    processor.add(request)
    rows = [[float(i)] for i in range(5)]
    processor.add_token_pooled(request, TokenPooled(0, torch.tensor(rows[:3])))
    processor.add_token_pooled(request, TokenPooled(0, torch.tensor(rows[:2])))  # recomputed after preemption
    processor.add_token_pooled(request, TokenPooled(2, torch.tensor(rows[2:5])))
    assert processor._streams[request].pooled == rows
    with pytest.raises(AssertionError, match="from position 7, but only 5 are known"):
        processor.add_token_pooled(request, TokenPooled(7, torch.tensor(rows[:1])))


def test_two_ranks_give_the_same_token_vectors(tiny_llama: Path) -> None:
    """Under tensor parallel rank 0 reads the gathered states: the vectors of one process."""
    single = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=64)
    expected = [o.outputs.data for o in single.encode(PROMPTS[1:3], pooling_task="token_embed")]
    with LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=64, tensor_parallel_size=2) as ranks:
        got = [o.outputs.data for o in ranks.encode(PROMPTS[1:3], pooling_task="token_embed")]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expected, strict=True))
