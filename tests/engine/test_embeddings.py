"""LLM.embed (SamplingParams.embed): last-token pooling against transformers' own hidden
states, through chunked prefill and prefix-cache hits, and bit-identical in bf16 whatever
else the batch holds."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


def reference_embedding(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    return torch.nn.functional.normalize(hidden[0, -1].float(), dim=-1)


def test_embeddings_are_the_normalized_last_hidden_state(tiny_llama) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 40, 90)]
    # Chunks of 32 tokens: the 90-token prompt's embedding comes from its third chunk.
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        vector = torch.tensor(output.outputs.embedding)
        assert vector.shape == (64,) and torch.linalg.vector_norm(vector).item() == pytest.approx(1.0, abs=1e-6)
        assert torch.allclose(vector, reference_embedding(model, prompt), atol=1e-5)
    again = llm.embed(prompts[2:])  # served by the prefix cache up to each last token
    assert [o.num_cached_tokens for o in again] == [39, 89]
    for prompt, output in zip(prompts[2:], again, strict=True):
        assert torch.allclose(torch.tensor(output.outputs.embedding), reference_embedding(model, prompt), atol=1e-5)
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_in_bf16_an_embedding_is_bit_identical_alone_and_beside_generation(tiny_llama) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(30)]
    others = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 50))] for _ in range(5)]
    llm = LLM(str(tiny_llama), dtype="bfloat16", num_blocks=128, enable_prefix_caching=False)
    alone = llm.embed([prompt])[0].outputs.embedding
    generate = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    embed = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling="embed")
    mixed = llm.generate([others[0], prompt, *others[1:]], [generate, embed] + [generate] * 4)
    assert mixed[1].pooled == alone
    assert all(o.pooled is None for i, o in enumerate(mixed) if i != 1)
