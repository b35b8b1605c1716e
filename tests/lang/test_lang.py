"""kvloom.lang on the tiny model (float32), in-process: select's scores against
transformers' log-probabilities, gen against transformers' greedy continuation,
forks and successive calls hitting the radix cache (the engine's cached-token counts),
batches, streaming, and the errors a program author meets."""

from __future__ import annotations

import linecache
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvloom.lang as kl
from kvloom import LLM


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> Iterator[kl.Local]:
    local = kl.Local(LLM(str(tiny_llama), dtype="float32", num_blocks=256))
    yield local
    local.close()


@pytest.fixture(scope="module")
def exact(tiny_llama: Path) -> Iterator[kl.Local]:
    """bf16: the batch-invariant kernels make greedy output independent of what else
    runs in the batch, so batched, alone and remote runs can be compared exactly."""
    local = kl.Local(LLM(str(tiny_llama), dtype="bfloat16", num_blocks=256))
    yield local
    local.close()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> torch.nn.Module:
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def transformers_logprob(model: torch.nn.Module, prefix: list[int], full: list[int]) -> float:
    """Sum of log p(full[i] | full[:i]) over the tokens past ``prefix``'s common part."""
    start = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), min(len(prefix), len(full)))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, full[i]].item() for i in range(max(1, start), len(full)))


@kl.function
def classify(s, question: str) -> None:
    s += kl.system("Answer with one word.")
    s += kl.user(question)
    s += kl.assistant(kl.select("answer", ["yes", "no", "maybe later", "perhaps"]))


def test_select_scores_are_transformers_log_probabilities(backend: kl.Local, reference: torch.nn.Module) -> None:
    state = classify.run(question="Is the river cold in winter?", backend=backend)
    prefix_text = state.text[: -len(state["answer"]) - len(backend.role_markers("assistant")[1])]
    prefix = backend.encode(prefix_text)
    expected = {c: transformers_logprob(reference, prefix, backend.encode(prefix_text + c))
                for c in ["yes", "no", "maybe later", "perhaps"]}
    assert state.select_scores["answer"] == pytest.approx(expected, abs=1e-3)
    assert state["answer"] == max(expected, key=expected.__getitem__)
    # One forward computed the shared prefix; the other choices hit it in the cache.
    hits = state.select_cached_tokens[0]
    assert hits[0] == 0 and all(h >= 16 for h in hits[1:])


@kl.function
def two_turns(s) -> None:
    s += kl.user("Tell me about the fox.")
    s += kl.assistant(kl.gen("first", max_tokens=6))
    s += kl.user("And the river?")
    s += kl.assistant(kl.gen("second", max_tokens=6))


def test_gen_is_transformers_greedy_and_the_second_turn_hits(backend: kl.Local, reference: torch.nn.Module) -> None:
    state = two_turns.run(backend=backend)
    before, _ = backend.role_markers("assistant")
    prompt = backend.encode(state.text.split(before + state["first"])[0] + before)
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert state["first"] == backend.tokenizer.decode(greedy.tolist())
    first, second = state.calls
    assert (first.name, second.name) == ("first", "second")
    # No whole block of it was cached (the module's earlier calls share at most the chat
    # template's first tokens, which a partial block serves).
    assert first.num_cached_tokens < 16
    # Timed on the state's thread: the first text comes before the whole answer.
    assert all(c.first_text_s is not None and 0 < c.first_text_s <= c.seconds for c in state.calls)
    # The second call's prompt starts with the first call's text: its full blocks hit.
    assert second.num_cached_tokens >= (first.num_prompt_tokens // 16) * 16 > 0


@kl.function
def drafts(s, ticket: str) -> None:
    s += kl.system("You sort support tickets.")
    s += kl.user(ticket)
    s += kl.assistant(kl.select("team", ["billing", "bugs", "sales"]))
    forks = s.fork(3)
    for i, fork in enumerate(forks):
        fork += kl.user(f"Reply draft {i}:") + kl.assistant(kl.gen("draft", max_tokens=5))
    s["drafts"] = [f["draft"] for f in forks]


def test_forks_share_the_prefix_and_a_batch_runs_each_program(exact: kl.Local) -> None:
    backend = exact
    alone = drafts.run(ticket="I was charged twice.", backend=backend)
    assert len(alone["drafts"]) == 3 and alone["team"] in ("billing", "bugs", "sales")
    shared = len(backend.encode(alone.text))
    for fork in alone.forks:
        (call,) = fork.calls
        assert call.num_cached_tokens >= (shared // 16) * 16 > 0  # the parent's text, computed once
    tickets = ["I was charged twice.", "The app crashes.", "Gift cards?"]
    batch = drafts.run_batch([{"ticket": t} for t in tickets], backend=backend)
    assert batch[0].variables() == alone.variables()  # greedy: the same, batched with others
    for state, ticket in zip(batch, tickets, strict=True):
        assert ticket in state.text and state["drafts"] == drafts.run(ticket=ticket, backend=backend)["drafts"]


def test_the_text_streams_as_it_is_generated(backend: kl.Local, endpoint: kl.Endpoint) -> None:
    for source in (backend, endpoint):
        state = two_turns.run(backend=source, stream=True)
        pieces = list(state.text_stream())
        assert "".join(pieces) == state.text
        # The first gen's 6 tokens came in several pieces, between the assistant's markers.
        before, after = source.role_markers("assistant")
        opening = pieces.index(before)
        generated = pieces[opening + 1:pieces.index(after, opening + 1)]
        assert "".join(generated) == state["first"] and len(generated) >= 2


@kl.function
def bad_regex(s) -> None:
    s += kl.gen("code", regex="(unclosed")


def _line_of(error: kl.LangError, text: str) -> None:
    assert error.where is not None
    assert text in linecache.getline(error.where.filename, error.where.lineno)


def test_errors_name_the_program_line(backend: kl.Local) -> None:
    @kl.function
    def reads_too_early(s) -> None:
        s += kl.user("hi")
        s["answer"]  # never generated

    with pytest.raises(kl.LangError, match="variable 'answer' is read before anything generated it") as caught:
        reads_too_early.run(backend=backend)
    _line_of(caught.value, 's["answer"]  # never generated')

    with pytest.raises(kl.LangError, match="empty choice list") as caught:
        kl.select("team", [])
    _line_of(caught.value, 'kl.select("team", [])')

    with pytest.raises(kl.LangError, match="gen 'code' was refused") as caught:
        bad_regex.run(backend=backend)
    _line_of(caught.value, 'kl.gen("code", regex="(unclosed")')

    state = classify.run(question="Is it?", backend=backend)
    with pytest.raises(kl.LangError, match="fork of a finished state") as caught:
        state.fork(2)
    _line_of(caught.value, "state.fork(2)")
    with pytest.raises(kl.LangError, match="no backend"):
        kl.set_default_backend(None)  # type: ignore[arg-type]
        classify.run(question="x")
    # After all that, the engine's books balance.
    backend.llm.engine.check_integrity()


@pytest.fixture(scope="module")
def endpoint(tiny_llama: Path) -> Iterator[kl.Endpoint]:
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.server.background import start_background_server
    from kvloom.server.settings import ServerSettings

    config = EngineConfig.from_kwargs(str(tiny_llama), dtype="bfloat16", num_blocks=256)
    server = start_background_server(lambda: LLMEngine(config), ServerSettings(), 1024, None, 60.0)
    remote = kl.Endpoint(server.base_url)
    yield remote
    remote.close()
    server.stop()


def test_the_same_program_gives_the_same_output_against_a_server(exact: kl.Local, endpoint: kl.Endpoint) -> None:
    backend = exact
    for program, kwargs in ((drafts, {"ticket": "I was charged twice."}), (two_turns, {}),
                            (classify, {"question": "Is the river cold in winter?"})):
        local, remote = program.run(backend=backend, **kwargs), program.run(backend=endpoint, **kwargs)
        assert remote.variables() == local.variables() and remote.text == local.text
    remote = classify.run(question="Is the river cold in winter?", backend=endpoint)
    local = classify.run(question="Is the river cold in winter?", backend=backend)
    assert remote.select_scores["answer"] == pytest.approx(local.select_scores["answer"], abs=1e-4)
    # The server's cache served the repeated program: its choices hit.
    assert all(hit > 0 for hit in remote.select_cached_tokens[0])


def test_a_constraint_the_server_refuses_names_the_program_line(endpoint: kl.Endpoint) -> None:
    with pytest.raises(kl.LangError, match="gen 'code' was refused") as caught:
        bad_regex.run(backend=endpoint)
    _line_of(caught.value, 'kl.gen("code", regex="(unclosed")')


def test_the_score_endpoint_refuses_bad_bodies(endpoint: kl.Endpoint) -> None:
    for body, param in (({"prompt": "x", "choices": []}, "choices"), ({"prompt": "x", "choices": ["a", ""]}, "choices"),
                        ({"choices": ["a"]}, "prompt"), ({"prompt": "", "choices": ["a", "bc"]}, "prompt"),
                        # " " + "a" is the one token " a": nothing of the choice follows the prompt.
                        ({"prompt": " ", "choices": ["hello", "a"]}, "choices[1]"),
                        ({"prompt": "x", "choices": ["a", " y" * 5000]}, "choices[1]")):
        response = endpoint.client.post("/kvloom/score", json=body)
        assert response.status_code == 400, response.text
        assert param in response.json()["error"]["message"] + str(response.json()["error"]["param"])


def test_a_program_s_own_error_is_the_one_raised(backend: kl.Local) -> None:
    @kl.function
    def divides(s) -> None:
        s += kl.gen("code", regex="(unclosed")  # fails on the state's thread ...
        raise ZeroDivisionError("the program's own")  # ... but this is what the author sees

    with pytest.raises(ZeroDivisionError, match="the program's own"):
        divides.run(backend=backend)
    backend.llm.engine.check_integrity()


@kl.function
def one_gen(s) -> None:
    s += kl.user("Say something.")
    s += kl.assistant(kl.gen("answer", max_tokens=4))


def test_an_engine_fault_fails_the_call_and_leaves_the_backend_idle(tiny_llama: Path, monkeypatch) -> None:
    """A step that raises fails the program's call with a LangError naming the program's
    line (not "refused": the input was fine), aborts the call's request (the driver does
    not step it again and again), and the next program runs as before the fault."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", num_blocks=64)
    local = kl.Local(llm)
    try:
        expected = one_gen.run(backend=local)["answer"]
        launch = llm.engine.runner.launch
        monkeypatch.setattr(llm.engine.runner, "launch", lambda scheduled: (_ for _ in ()).throw(
            RuntimeError("injected fault")))
        with pytest.raises(kl.LangError, match=r"gen 'answer' failed: the engine failed in a step "
                                               r"\(RuntimeError: injected fault\)") as caught:
            one_gen.run(backend=local)
        _line_of(caught.value, 's += kl.assistant(kl.gen("answer", max_tokens=4))')
        with local._wake:  # the driver has nothing left to step (its own lock: no race with it)
            assert not llm.engine.has_unfinished_requests()
        monkeypatch.setattr(llm.engine.runner, "launch", launch)
        assert one_gen.run(backend=local)["answer"] == expected
        llm.engine.check_integrity()
    finally:
        local.close()
    with pytest.raises(kl.LangError, match="gen 'answer' failed: this kl.Local backend is closed"):
        one_gen.run(backend=local)  # before, this waited forever


def test_a_select_with_nothing_before_it_is_a_lang_error(backend: kl.Local) -> None:
    @kl.function
    def bare(s) -> None:
        s += kl.select("x", ["a", "b"])

    with pytest.raises(kl.LangError, match="select 'x' was refused: the prompt is empty") as caught:
        bare.run(backend=backend)
    _line_of(caught.value, 's += kl.select("x", ["a", "b"])')


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(stop=""), "stop must be non-empty strings"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
])
def test_gen_values_are_checked_where_gen_is_called(kwargs, message) -> None:
    """Before, these surfaced at the program's next sync point as a bare ValueError."""
    with pytest.raises(kl.LangError, match=f"gen 'x': {message}") as caught:
        kl.gen("x", **kwargs)
    _line_of(caught.value, 'kl.gen("x", **kwargs)')
