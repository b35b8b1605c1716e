"""The programs of examples/lang_programs.py run on the tiny model and do what they say:
few-shot picks one of its labels, the tree has 3 x 3 refinements, the chat has four
answers, the extraction is JSON under its schema."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import kvloom.lang as kl
from kvloom import LLM

EXAMPLE = Path(__file__).parents[2] / "examples" / "lang_programs.py"


@pytest.fixture(scope="module")
def examples():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("lang_programs", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_programs_run(examples, tiny_llama: Path) -> None:  # type: ignore[no-untyped-def]
    backend = kl.Local(LLM(str(tiny_llama), dtype="float32", num_blocks=512))
    try:
        runs = {name: program.run_batch(inputs(2), backend=backend)
                for name, (program, inputs) in examples.WORKLOADS.items()}
        assert all(s["label"] in ("positive", "negative", "neutral") for s in runs["few_shot"])
        for state in runs["tree_of_thought"]:
            assert len(state["ideas"]) == 3 and all(len(idea["refined"]) == 3 for idea in state["ideas"])
        assert all(all(f"answer{t}" in s for t in range(4)) for s in runs["multi_turn"])
        for state in runs["json_extraction"]:
            person = json.loads(state["person"])
            assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
        # A select's choices share its prefix: at most one of them (the first admitted,
        # which the others wait for) computes it; concurrent programs may race for that.
        for state in runs["few_shot"]:
            assert all(hit > 0 for hit in sorted(state.select_cached_tokens[0])[1:])
        backend.llm.engine.check_integrity()
    finally:
        backend.close()
