"""The radix prefix cache inside the engine: same outputs, far fewer computed tokens."""

from __future__ import annotations

import random

import pytest
from helpers_engine import run_arrivals

from kvloom import SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(path, **kwargs) -> LLMEngine:
    args = dict(dtype="float32", block_size=16, num_blocks=512, trace=True)
    args.update(kwargs)
    return LLMEngine(EngineConfig.from_kwargs(str(path), **args))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY):
    return run_arrivals(engine, {0: [(request_id, prompt, params) for request_id, prompt in prompts.items()]})


def prefill_tokens_computed(engine: LLMEngine) -> int:
    return sum(entry.num_tokens for record in engine.scheduler.trace.records
               for entry in record.scheduled if entry.kind == "prefill")


def test_outputs_identical_with_cache_on_and_off_including_split_blocks(tiny_llama) -> None:
    rng = random.Random(1)
    system = [rng.randrange(3, 512) for _ in range(37)]  # not a multiple of the block size
    prompts = {}
    for i in range(12):
        # Some prompts diverge inside a block of the shared part, splitting radix nodes.
        cut = rng.choice([37, 20, 33, 5])
        prompts[f"r{i}"] = system[:cut] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
    on = run(make_engine(tiny_llama), prompts)
    off = run(make_engine(tiny_llama, enable_prefix_caching=False), prompts)
    assert {k: v.outputs[0].token_ids for k, v in on.items()} == {k: v.outputs[0].token_ids for k, v in off.items()}
    assert sum(o.num_cached_tokens for o in on.values()) > 0
    assert all(o.num_cached_tokens == 0 and o.cache_miss_reason == "prefix cache disabled" for o in off.values())


@pytest.fixture(scope="module")
def tiny_long_context(tmp_path_factory):
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("long"), arch="llama", max_position_embeddings=2048)


def test_shared_system_prompt_is_computed_once(tiny_long_context) -> None:
    tiny_llama = tiny_long_context
    rng = random.Random(2)
    system = [rng.randrange(3, 512) for _ in range(1000)]
    prompts = {f"q{i}": system + [rng.randrange(3, 512) for _ in range(8)] for i in range(32)}
    config = dict(max_model_len=2048, num_blocks=1024)
    off_engine = make_engine(tiny_llama, enable_prefix_caching=False, **config)
    run(off_engine, prompts)
    on_engine = make_engine(tiny_llama, **config)
    run(on_engine, prompts)
    off_tokens, on_tokens = prefill_tokens_computed(off_engine), prefill_tokens_computed(on_engine)
    assert off_tokens == 32 * 1008
    assert on_tokens < 0.1 * off_tokens, (on_tokens, off_tokens)
    stats = on_engine.stats()
    assert stats.prefix_cache_hit_rate > 0.9


@pytest.mark.parametrize(("model", "dtype"), [("tiny_llama", "float32"), ("tiny_paired", "bfloat16")])
def test_multi_turn_reuses_previous_prompt_and_answer(model: str, dtype: str, request) -> None:
    path = request.getfixturevalue(model)
    engine = make_engine(path, dtype=dtype)
    rng = random.Random(4)
    turn1 = [rng.randrange(3, 512) for _ in range(50)]
    first = run(engine, {"t1": turn1}, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))["t1"]
    turn2 = turn1 + first.outputs[0].token_ids + [rng.randrange(3, 512) for _ in range(10)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    second = run(engine, {"t2": turn2}, params)["t2"]
    # Every token of turn 1 whose KV was computed is served: its whole blocks shared, the
    # last 79 % 16 = 15 copied from its tail; only the answer's last token (sampled, never
    # fed back) and the new message are computed.
    assert second.num_cached_tokens == len(turn1) + 30 - 1 == 79
    assert second.cache_miss_reason == ("prefix hit of 79 tokens, 15 of them copied from a cached block: "
                                        "token 79 differs from every cached continuation")
    assert engine.stats().num_block_copies == 1
    off = run(make_engine(path, dtype=dtype, enable_prefix_caching=False), {"t2": turn2}, params)["t2"]
    assert second.outputs[0].token_ids == off.outputs[0].token_ids
    assert second.outputs[0].logprobs == off.outputs[0].logprobs  # bit for bit


def test_reset_prefix_cache_drops_what_no_request_holds(tiny_llama) -> None:
    """vLLM's reset_prefix_cache: the next run of a prompt hits nothing; blocks a running
    request holds stay (False), and that request finishes as without the reset."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 512) for _ in range(40)]
    engine = make_engine(tiny_llama)
    first = run(engine, {"a": prompt})["a"]
    assert run(engine, {"b": prompt})["b"].num_cached_tokens == 39
    assert engine.reset_prefix_cache()
    assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks
    again = run(engine, {"c": prompt})["c"]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    engine.add_request(prompt + [7] * 20, GREEDY, request_id="held")
    engine.step()  # its prompt's whole blocks are cached and held by it
    assert not engine.reset_prefix_cache()
    assert engine.kv_manager.prefix_cache.num_cached_blocks == 3  # the held request's 60 // 16 blocks
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    off = run(make_engine(tiny_llama, enable_prefix_caching=False), {"held": prompt + [7] * 20})["held"]
    assert finals["held"].outputs[0].token_ids == off.outputs[0].token_ids


def test_eviction_under_pressure(tiny_llama) -> None:
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(3, 512) for _ in range(rng.randrange(30, 70))] for i in range(24)}
    reference = run(make_engine(tiny_llama, enable_prefix_caching=False), prompts)
    engine = make_engine(tiny_llama, num_blocks=20)  # far smaller than the working set
    results = run(engine, prompts)
    assert {k: v.outputs[0].token_ids for k, v in results.items()} == \
           {k: v.outputs[0].token_ids for k, v in reference.items()}
    assert engine.kv_manager.num_evicted_blocks > 0
    assert engine.kv_manager.num_available_blocks == 20


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_lpm_policy_prefers_cached_prefixes(tiny_llama, policy) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1, policy=policy)
    rng = random.Random(6)
    shared = [rng.randrange(3, 512) for _ in range(64)]
    run(engine, {"warm": shared + [1]})
    cold = {f"cold{i}": [rng.randrange(3, 512) for _ in range(64)] for i in range(3)}
    for request_id, prompt in cold.items():
        engine.add_request(prompt, GREEDY, request_id=request_id)
    engine.add_request(shared + [2, 3], GREEDY, request_id="hot")
    order = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
    if policy == "lpm":
        assert order[0] == "hot"
    else:
        assert order[-1] == "hot"


@pytest.fixture(scope="module")
def tiny_paired(tmp_path_factory):
    """head_dim 64: in bf16 the CPU backend's paired in-block order."""
    from helpers_models import write_tiny_hf_model
    return write_tiny_hf_model(tmp_path_factory.mktemp("paired"), arch="llama", hidden_size=256,
                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_hit_ending_inside_a_block_copies_it_and_changes_no_bit(tiny_paired, dtype: str) -> None:
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(37)]  # 2 blocks and 5 tokens
    lead = system + [rng.randrange(3, 512) for _ in range(12)]
    # Each follower's block 2 is system[32:37] and then tokens of its own, unlike the lead's.
    followers = {f"f{i}": system + [t for t in (rng.randrange(3, 512) for _ in range(20 + i)) if t != lead[37]]
                 for i in range(4)}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    engine = make_engine(tiny_paired, dtype=dtype)
    run(engine, {"lead": lead}, params)  # 49 + 7 tokens computed: its blocks 0-2 are cached
    on = run(engine, followers, params)
    off = run(make_engine(tiny_paired, dtype=dtype, enable_prefix_caching=False), followers, params)
    for request_id in followers:
        assert on[request_id].outputs[0].token_ids == off[request_id].outputs[0].token_ids
        assert on[request_id].outputs[0].logprobs == off[request_id].outputs[0].logprobs  # bit for bit
        assert on[request_id].num_cached_tokens == 37  # 32 shared, 5 copied
        assert on[request_id].cache_miss_reason == ("prefix hit of 37 tokens, 5 of them copied from a cached "
                                                   "block: token 37 differs from every cached continuation")
    assert engine.stats().num_block_copies == 4
    # The followers computed 37 tokens fewer each than without the cache.
    assert prefill_tokens_computed(engine) == len(lead) + sum(len(p) - 37 for p in followers.values())


def test_a_partial_block_gives_way_when_locking_its_source_would_leave_no_room(tiny_llama) -> None:
    """The copy's source node stays locked until the copy; where that lock is all that
    keeps eviction from making room, the request is admitted without the partial block
    (it computes those tokens) rather than waiting for ever on an idle engine."""
    rng = random.Random(6)
    lead = [rng.randrange(3, 512) for _ in range(70)]
    follower = lead[:8] + [t for t in (rng.randrange(3, 512) for _ in range(120)) if t != lead[8]][:112]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_llama, num_blocks=8)
    run(engine, {"lead": lead}, SamplingParams(max_tokens=1, temperature=0.0))  # 4 blocks cached, one node
    engine.add_request(follower, params, request_id="follower")
    finals = {}
    for _ in range(40):  # it needs 8 blocks: the 4 cached ones must all be evicted
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert "follower" in finals, "the follower was never admitted"
    off = run(make_engine(tiny_llama, enable_prefix_caching=False), {"follower": follower}, params)
    assert finals["follower"].outputs[0].token_ids == off["follower"].outputs[0].token_ids
    assert finals["follower"].num_cached_tokens == 0 and engine.stats().num_block_copies == 0
    assert finals["follower"].cache_miss_reason == ("prefix hit of 0 tokens; the 8 after them are computed: "
                                                    "the pool had no room to copy the cached block that holds them")


def test_cache_salts_keep_tenants_apart_and_change_no_output(tiny_llama) -> None:
    """vLLM's cache_salt: the same prompts under two salts each compute the shared prefix
    once for their own salt (arriving together: the in-flight wait is per salt too), hit
    only within it, and decode exactly what they decode without a cache."""
    rng = random.Random(5)
    system = [rng.randrange(3, 512) for _ in range(64)]  # four whole blocks
    questions = [[rng.randrange(3, 512) for _ in range(8)] for _ in range(3)]
    engine = make_engine(tiny_llama)
    arrivals = [(f"{salt}{i}", system + q, GREEDY, salt) for salt in ("a", "b") for i, q in enumerate(questions)]
    for request_id, prompt, params, salt in arrivals:
        engine.add_request(prompt, params, request_id=request_id, cache_salt=salt)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    # Per salt: the first request computes the 72-token prompt, the others 8 each.
    assert prefill_tokens_computed(engine) == 2 * (72 + 8 + 8)
    assert {rid: o.num_cached_tokens for rid, o in finals.items()} == {
        "a0": 0, "a1": 64, "a2": 64, "b0": 0, "b1": 64, "b2": 64}
    # A third tenant, and the unsalted, find nothing of theirs.
    for request_id, salt in (("c", "c"), ("none", None)):
        engine.add_request(system + questions[0], GREEDY, request_id=request_id, cache_salt=salt)
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals[request_id].num_cached_tokens == 0
    engine.check_integrity()
    plain = run(make_engine(tiny_llama, enable_prefix_caching=False),
                {f"p{i}": system + q for i, q in enumerate(questions)})
    for salt in ("a", "b"):
        assert [finals[f"{salt}{i}"].outputs[0].token_ids for i in range(3)] == [
            plain[f"p{i}"].outputs[0].token_ids for i in range(3)]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        engine.add_request([5, 6, 7], GREEDY, cache_salt="")


def test_llm_generate_and_chat_take_a_cache_salt(tiny_llama) -> None:
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=128)
    prompt = list(range(100, 148))  # three blocks
    cached = [llm.generate([prompt], GREEDY, cache_salt=salt)[0].num_cached_tokens for salt in ("a", "b", "a", None)]
    assert cached == [0, 0, 47, 0]
    chat = [{"role": "user", "content": "a question long enough to fill a few blocks " * 3}]
    assert [llm.chat(chat, GREEDY, cache_salt=salt)[0].num_cached_tokens > 0 for salt in ("c", "d", "c")] == [
        False, False, True]
    llm.engine.check_integrity()
