"""Engine behaviour on a tiny real model: batch invariance, arrivals mid-run, stop
conditions, streaming deltas, aborts, n > 1 — with block accounting after each."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_engine import run_arrivals, token_ids

from kvloom import LLM, BeamSearchParams, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine_factory(tiny_llama):
    def make(**kwargs) -> LLMEngine:
        args = dict(dtype="float32", block_size=16, num_blocks=256)
        args.update(kwargs)
        return LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), **args))
    return make


def run_all(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]
            ) -> dict[str, list[int]]:
    """Step the engine, adding requests at the given step numbers; returns token ids."""
    return token_ids(run_arrivals(engine, arrivals))


def test_batch_invariance_with_staggered_arrivals(engine_factory) -> None:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 512) for _ in range(rng.choice([1, 3, 9, 16, 31, 50, 77]))]
               for i in range(16)}
    params = {rid: SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0.0, ignore_eos=True)
              for rid in prompts}
    alone = {}
    for rid, prompt in prompts.items():
        alone.update(run_all(engine_factory(), {0: [(rid, prompt, params[rid])]}))
    arrivals: dict[int, list] = {}
    for i, rid in enumerate(prompts):
        arrivals.setdefault(i // 3 * 2, []).append((rid, prompts[rid], params[rid]))
    engine = engine_factory(max_num_batched_tokens=64)
    together = run_all(engine, arrivals)
    assert together == alone
    assert engine.kv_manager.num_available_blocks == 256


def test_seeded_sampling_independent_of_batch(engine_factory) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)
    alone = run_all(engine_factory(), {0: [("s", [5, 6, 7], seeded)]})
    mixed = run_all(engine_factory(), {0: [("o1", [9] * 20, other)],
                                       1: [("s", [5, 6, 7], seeded), ("o2", [11, 12], other)]})
    assert mixed["s"] == alone["s"]


def test_stop_strings_never_appear_and_deltas_concatenate(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, skip_special_tokens=False)
    free_text = llm.generate([[10, 20, 30]], base)[0].outputs[0].text
    assert len(free_text) > 6
    stop = free_text[3:6]
    engine = llm.engine
    engine.add_request([10, 20, 30], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                    skip_special_tokens=False, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == free_text[: free_text.find(stop)]
    assert "".join(deltas) == final.outputs[0].text
    engine.check_integrity()


def test_max_tokens_min_tokens_and_stop_token_ids(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    assert len(tokens) == 10 and free.outputs[0].finish_reason == "length"
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    llm.engine.check_integrity()


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_a_stop_tokens_text_is_not_output_unless_asked(tiny_llama, kind) -> None:
    """vLLM's rule: a request that stops at a token (a stop token id, EOS) keeps that
    token's id but not its text, unless include_stop_str_in_output; the same text
    whether it was detokenized token by token or once at the end (FINAL_ONLY)."""
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    for include in (False, True):
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id],
                                                       include_stop_str_in_output=include, output_kind=kind))[0]
        assert out.outputs[0].token_ids == tokens[:first + 1]
        assert out.outputs[0].text == llm.tokenizer.decode(tokens[:first + include])
    eos = llm.engine.eos_token_ids[0]  # EOS, a special token, shown by skip_special_tokens=False
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=[eos],
                                                   skip_special_tokens=False, output_kind=kind))[0]
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].text == "" and out.outputs[0].finish_reason == "stop"
    assert llm.tokenizer.decode([eos], skip_special_tokens=False) != ""
    llm.engine.check_integrity()


def test_no_max_tokens_generates_up_to_the_context_or_the_pool(engine_factory) -> None:
    """max_tokens=None runs to the context (64 here) or, where the pool is smaller (2
    blocks of 16 = 32 tokens), to the pool's size: capped as the server caps it, not
    refused as too large for the pool."""
    for num_blocks, capacity in [(2, 32), (256, 64)]:
        engine = engine_factory(num_blocks=num_blocks, max_model_len=64)
        finals = run_all(engine, {0: [("a", [1] * 10, SamplingParams(max_tokens=None, ignore_eos=True))]})
        assert len(finals["a"]) == capacity - 10
        engine.check_integrity()
        assert engine.kv_manager.num_available_blocks == num_blocks


def test_abort_running_and_waiting_frees_blocks(engine_factory) -> None:
    engine = engine_factory(max_num_seqs=1)
    engine.add_request([1] * 40, SamplingParams(max_tokens=50), request_id="a")
    engine.add_request([2] * 40, SamplingParams(max_tokens=50), request_id="b")
    engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_available_blocks == 256


def test_n_samples_and_input_order(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=128)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    outputs = llm.generate([[4, 5], [6, 7, 8], [9]], params)
    assert [o.prompt_token_ids for o in outputs] == [[4, 5], [6, 7, 8], [9]]
    assert all(len(o.outputs) == 3 and [c.index for c in o.outputs] == [0, 1, 2] for o in outputs)
    again = llm.generate([[4, 5]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outputs[0].outputs]


def test_bad_requests_rejected_with_clear_errors(engine_factory) -> None:
    engine = engine_factory(num_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="context"):
        engine.add_request([1] * 200, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 99999], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="token ids .* got \\[True\\]"):  # bool is an int to Python
        engine.add_request([1, True], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    engine.check_integrity()


def test_chat_uses_template(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_the_offline_progress_bar_counts_output_tokens(tiny_llama, capsys) -> None:
    """Two prompts, 5 and 3 tokens each (ignore_eos): the bar's last line reports both
    requests and all 8 output tokens."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    params = [SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)]
    outputs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 3]
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "2/2" in last and "output 8 tok" in last


def test_offline_logit_bias_and_chat_template_options(tiny_llama) -> None:
    """vLLM's offline logit_bias (dict[int, float]) steers greedy decoding; LLM.chat passes
    continue_final_message to the template as transformers does."""
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={77: 100.0}))[0]
    assert out.outputs[0].token_ids == [77] * 4
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    chat = llm.chat(messages, SamplingParams(max_tokens=1), add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False).endswith("The answer")


def test_a_context_longer_than_the_model_allows_is_refused(tiny_llama, tmp_path) -> None:
    """A configured max_model_len past the model's positions (512 here) is refused when
    the engine is built, as vLLM refuses it (it was cut to the model's length without a
    word); up to them it is served, past a sliding window too (attended as one:
    tests/models/test_sliding_window.py)."""
    from helpers_models import write_tiny_hf_model

    from kvloom.models.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="max_model_len 513 is longer than the model allows: its 512 positions"):
        LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=8, max_model_len=513))
    windowed = write_tiny_hf_model(tmp_path / "mistral", "mistral", sliding_window=128)
    assert LLMEngine(EngineConfig.from_kwargs(str(windowed), dtype="float32", num_blocks=8)).max_model_len == 512


def test_vllms_prompt_dicts_are_prompts(tiny_llama) -> None:
    """{"prompt": text} and {"prompt_token_ids": ids}, as vLLM's LLM takes them: the same
    requests as the text and the ids, held to transformers' greedy tokens; another dict
    is refused, named, before anything runs."""
    import transformers
    from helpers_models import hf_greedy_tokens

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    text_ids = llm.tokenizer.encode("hello there")
    outputs = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": [4, 5, 6]}], params)
    assert [o.prompt_token_ids for o in outputs] == [text_ids, [4, 5, 6]]
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy_tokens(reference, ids, 6)
                                                         for ids in (text_ids, [4, 5, 6])]
    beams = llm.beam_search({"prompt_token_ids": [4, 5, 6]}, BeamSearchParams(beam_width=2, max_tokens=3,
                                                                               ignore_eos=True))
    assert beams[0].prompt_token_ids == [4, 5, 6] and len(beams[0].sequences) == 2
    with pytest.raises(ValueError, match=r"prompt 1 must be .* got a dict with keys \['multi_modal_data', 'prompt'\]"):
        llm.generate([{"prompt": "a"}, {"prompt": "b", "multi_modal_data": {}}], params)
    assert not llm.engine.has_unfinished_requests()
