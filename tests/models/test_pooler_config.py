"""How embeddings are pooled (vLLM's PoolerConfig): a sentence-transformers directory's
Pooling module (the mean of the prompt's states, or its first token's) and Normalize
module (none: not normalized) are read as vLLM reads them, and ``--pooler-config``
overrides them; each held to transformers' ``last_hidden_state`` pooled by hand. The
mean's bits do not depend on the chunking or the batch; a mode kvloom does not compute
is refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers_models import write_tiny_hf_model

from kvloom import LLM
from kvloom.config import EngineConfig

transformers = pytest.importorskip("transformers")

RNG = random.Random(9)
PROMPTS = [[RNG.randrange(3, 500) for _ in range(n)] for n in (1, 12, 37, 70)]


def sentence_transformers_dir(path: Path, modes: dict[str, bool], normalize: bool) -> Path:
    """The tiny model as a sentence-transformers directory: modules.json, a Pooling
    module's config.json and, if asked, a Normalize module."""
    model = write_tiny_hf_model(path, arch="llama", seed=3)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model / "modules.json").write_text(json.dumps(modules))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return model


def states(model: Path, prompt: list[int]) -> torch.Tensor:
    reference = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(torch.tensor([prompt])).last_hidden_state[0]


def test_a_sentence_transformers_mean_pooling_model_embeds_as_it_says(tmp_path: Path) -> None:
    model = sentence_transformers_dir(tmp_path / "mean", {"pooling_mode_mean_tokens": True}, normalize=True)
    llm = LLM(str(model), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.model_config.pooler.seq_pooling == "MEAN"
    for output, prompt in zip(llm.embed(PROMPTS), PROMPTS, strict=True):
        want = torch.nn.functional.normalize(states(model, prompt).mean(dim=0), dim=0)
        assert torch.allclose(torch.tensor(output.outputs.embedding), want, atol=1e-5)
    again = llm.embed(PROMPTS[3:])[0]
    assert again.num_cached_tokens == 0  # a mean reads every position: no prefix hit


def test_the_first_tokens_state_without_normalize_and_the_flag_over_the_directory(tmp_path: Path) -> None:
    model = sentence_transformers_dir(tmp_path / "cls", {"pooling_mode_cls_token": True}, normalize=False)
    llm = LLM(str(model), dtype="float32", block_size=16, num_blocks=64)
    first = llm.embed(PROMPTS[2:3])[0].outputs.embedding
    assert torch.allclose(torch.tensor(first), states(model, PROMPTS[2])[0], atol=1e-5)  # not normalized
    last = LLM(str(model), dtype="float32", block_size=16, num_blocks=64, pooler_config={"pooling_type": "LAST"})
    assert torch.allclose(torch.tensor(last.embed(PROMPTS[2:3])[0].outputs.embedding), states(model, PROMPTS[2])[-1],
                          atol=1e-5)  # the flag's pooling type, the directory's normalization (none)
    plain = write_tiny_hf_model(tmp_path / "plain", arch="llama", seed=3)
    mean = LLM(str(plain), dtype="float32", block_size=16, num_blocks=64,
               pooler_config='{"pooling_type": "MEAN", "use_activation": false}')
    assert torch.allclose(torch.tensor(mean.embed(PROMPTS[1:2])[0].outputs.embedding),
                          states(plain, PROMPTS[1]).mean(dim=0), atol=1e-5)
    tokens = mean.encode(PROMPTS[1:2], pooling_task="token_embed")[0].outputs.data  # not normalized either
    assert torch.allclose(tokens, states(plain, PROMPTS[1]), atol=1e-5)


def test_a_mean_is_the_same_bits_alone_batched_and_chunked(tmp_path: Path) -> None:
    model = sentence_transformers_dir(tmp_path / "mean", {"pooling_mode_mean_tokens": True}, normalize=True)
    whole = LLM(str(model), dtype="bfloat16", block_size=16, num_blocks=64)
    chunked = LLM(str(model), dtype="bfloat16", block_size=16, num_blocks=64, max_num_batched_tokens=24)
    alone = [whole.embed([p])[0].outputs.embedding for p in PROMPTS]
    assert [o.outputs.embedding for o in whole.embed(PROMPTS)] == alone
    assert [o.outputs.embedding for o in chunked.embed(PROMPTS)] == alone


def test_what_kvloom_does_not_pool_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS or ALL, got 'MAX'"):
        EngineConfig.from_kwargs("x", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooler_config: normalize not supported"):
        EngineConfig.from_kwargs("x", pooler_config='{"normalize": true}')
    model = sentence_transformers_dir(tmp_path / "max", {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling pooling_mode_max_tokens is not supported"):
        LLM(str(model), dtype="float32", block_size=16, num_blocks=16)
