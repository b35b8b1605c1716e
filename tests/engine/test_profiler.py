"""start_profile / stop_profile (vLLM's): the torch profiler over the engine's steps. The
trace is a gzipped Chrome trace with one ProfilerStep span per engine step and kvloom's
own kernels under their op names; profiling changes no token; misuse is a ValueError."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from kvloom import LLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9]


def test_a_profile_records_each_step_and_changes_no_token(tiny_llama, tmp_path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    llm.start_profile()
    with pytest.raises(ValueError, match="a profile is running already"):
        llm.start_profile()
    profiled = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    path = llm.stop_profile(tmp_path / "traces")
    assert profiled == plain
    assert path.parent == tmp_path / "traces" and path.name.endswith(".pt.trace.json.gz")
    names = Counter(event.get("name", "") for event in json.load(gzip.open(path))["traceEvents"])
    # One span per step: the prompt's, then three decodes (#0 is the time before the first).
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [f"ProfilerStep#{i}" for i in range(5)]
    assert names["kvloom::paged_attention"] > 0 and names["kvloom::rms_norm"] > 0
    with pytest.raises(ValueError, match="no profile is running"):
        llm.stop_profile(tmp_path)


def test_the_native_decoder_walk_is_a_span_of_its_own(tmp_path) -> None:
    """The walk over every layer (models/decoder_stack.py) is one native call, not a torch
    op: it shows as a kvloom::decoder_stack span in each step that runs it."""
    from helpers_models import write_tiny_hf_model
    model = write_tiny_hf_model(tmp_path / "model", arch="llama", hidden_size=128, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(str(model), dtype="bfloat16", num_blocks=64, block_size=16)
    assert llm.engine.model.native_stack is not None  # bf16 on a CPU, kvloom's GEMM: the walk serves it
    llm.start_profile()
    llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    names = Counter(event.get("name", "") for event in json.load(gzip.open(llm.stop_profile(tmp_path)))["traceEvents"])
    assert names["kvloom::decoder_stack"] == 3  # the prompt's step and two decodes
