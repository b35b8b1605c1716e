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
