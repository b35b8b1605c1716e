"""The programs of examples/lang_programs.py run on the tiny model and do what they say:
few-shot picks one of its labels, the tree has 3 x 3 refinements, the chat has four
answers, the extraction is JSON under its schema. The same logic as independent OpenAI
calls (examples/openai_calls.py, the baseline they are measured against) gives the
programs' greedy output and select scores against one server."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import kvloom.lang as kl
from kvloom import LLM

EXAMPLES_DIR = Path(__file__).parents[2] / "examples"


def load(name: str) -> ModuleType:
    """An example as its script sees itself: importable by name (openai_calls.py
    imports lang_programs)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def examples() -> ModuleType:
    return load("lang_programs")


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


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[str]:
    """bf16: the batch-invariant kernels make greedy output independent of what else
    is in the batch, so the two styles' outputs can be compared exactly."""
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.server.background import start_background_server
    from kvloom.server.settings import ServerSettings

    config = EngineConfig.from_kwargs(str(tiny_llama), dtype="bfloat16", num_blocks=512)
    live = start_background_server(lambda: LLMEngine(config), ServerSettings(), 1024, None, 60.0)
    yield live.base_url
    live.stop()


def test_the_openai_baseline_is_the_same_logic(examples: ModuleType, server: str) -> None:
    baseline = load("openai_calls")
    calls = baseline.Calls(server)
    endpoint = kl.Endpoint(server)
    try:
        for name in ("few_shot", "multi_turn", "json_extraction"):  # the greedy ones
            program, inputs = examples.WORKLOADS[name]
            batch = inputs(2)
            before = examples.server_counters(server)
            states = program.run_batch(batch, backend=endpoint)
            counted = examples.token_figures(before, examples.server_counters(server), 1.0)
            assert counted["prompt_tokens_computed"] > 0 and 0 < counted["cache_hit_rate"] < 1
            answers = baseline.run_batch(calls, name, batch)
            for state, answer in zip(states, answers, strict=True):
                if name == "few_shot":
                    assert answer["label"] == state["label"]
                    assert answer["scores"] == pytest.approx(state.select_scores["label"], abs=1e-3)
                else:
                    variables = state.variables()
                    assert {key: variables[key] for key in answer if key != "first_text_s"} == \
                        {key: value for key, value in answer.items() if key != "first_text_s"}
            if name == "multi_turn":
                for timings in ([[c.first_text_s for c in s.calls] for s in states],
                                [a["first_text_s"] for a in answers]):
                    assert len(examples.ttft_by_turn(timings)) == examples.TURNS
    finally:
        endpoint.close()
