"""Routing policies on their own: no HTTP, no workers."""

from __future__ import annotations

import pytest

from kvloom.router.app import routing_key
from kvloom.router.config import RouterConfig
from kvloom.router.policy import (
    CACHE_HIT,
    CACHE_MISS,
    LOAD_BALANCE,
    PolicyConfig,
    WorkerLoad,
    make_policy,
)

A, B = "http://a:1", "http://b:1"
SYSTEM_1 = "You are a pirate. " * 20
SYSTEM_2 = "You are a lawyer. " * 20


def loads(a: int = 0, b: int = 0) -> list[WorkerLoad]:
    return [WorkerLoad(A, a), WorkerLoad(B, b)]


def test_cache_aware_keeps_a_system_prompt_on_one_worker_and_spreads_new_ones() -> None:
    policy = make_policy("cache_aware")
    first = policy.route(SYSTEM_1 + "question 0", loads())
    assert first.reason == CACHE_MISS
    other = policy.route(SYSTEM_2 + "question 0", loads())
    assert other.reason == CACHE_MISS and other.worker != first.worker  # the emptier tree
    for i in range(1, 10):
        decision = policy.route(SYSTEM_1 + f"question {i}", loads())
        assert (decision.worker, decision.reason) == (first.worker, CACHE_HIT)
        decision = policy.route(SYSTEM_2 + f"question {i}", loads())
        assert (decision.worker, decision.reason) == (other.worker, CACHE_HIT)


def test_cache_aware_routes_each_cache_salt_by_its_own_prefixes() -> None:
    """The same system prompt under two salts is two prefixes (the workers cache them
    apart): the second salt's first request is a miss, and each salt then stays put."""
    policy = make_policy("cache_aware")

    def key(salt: str, question: int) -> str:
        return routing_key("/v1/completions", {"prompt": SYSTEM_1 + f"question {question}", "cache_salt": salt})

    first = policy.route(key("t1", 0), loads())
    other = policy.route(key("t2", 0), loads())
    assert first.reason == other.reason == CACHE_MISS and other.worker != first.worker
    for i in range(1, 5):
        assert policy.route(key("t1", i), loads()) == first.__class__(first.worker, CACHE_HIT)
        assert policy.route(key("t2", i), loads()) == other.__class__(other.worker, CACHE_HIT)


def test_cache_aware_gives_way_to_the_least_loaded_beyond_both_thresholds() -> None:
    policy = make_policy("cache_aware", PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    home = policy.route(SYSTEM_1 + "q", loads()).worker
    busy = (lambda n: loads(a=n, b=0)) if home == A else (lambda n: loads(a=0, b=n))
    assert policy.route(SYSTEM_1 + "q1", busy(4)).reason == CACHE_HIT  # 4 - 0 is not > 4
    decision = policy.route(SYSTEM_1 + "q2", busy(5))
    assert decision.reason == LOAD_BALANCE and decision.worker != home
    # The relative threshold: 11 vs 6 is more than 4 apart but not more than 2x.
    heavy = [WorkerLoad(home, 11), WorkerLoad(B if home == A else A, 6)]
    assert policy.route(SYSTEM_1 + "q3", heavy).reason == CACHE_HIT


def test_cache_aware_below_the_threshold_is_a_miss() -> None:
    policy = make_policy("cache_aware", PolicyConfig(cache_threshold=0.9))
    home = policy.route("abcdefghij", loads()).worker
    # 5 of 10 chars shared: under 0.9, so the worker with less remembered text wins.
    decision = policy.route("abcde12345", loads())
    assert decision.reason == CACHE_MISS and decision.worker != home


def test_forget_worker_drops_its_hits() -> None:
    policy = make_policy("cache_aware")
    home = policy.route(SYSTEM_1, loads()).worker
    policy.forget_worker(home)
    assert policy.route(SYSTEM_1, [WorkerLoad(home, 0)]).reason == CACHE_MISS


def test_round_robin_and_least_loaded() -> None:
    rr = make_policy("round_robin")
    assert [rr.route("x", loads()).worker for _ in range(4)] == [A, B, A, B]
    least = make_policy("least_loaded")
    assert least.route("x", loads(a=3, b=1)).worker == B
    assert {least.route("x", loads()).worker for _ in range(2)} == {A, B}  # ties take turns


@pytest.mark.parametrize("kwargs, field", [
    ({"cache_threshold": 1.5}, "cache_threshold"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
    ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
    ({"balance_rel_threshold": float("nan")}, "balance_rel_threshold"),  # passed, and balancing was off
    ({"balance_abs_threshold": float("nan")}, "balance_abs_threshold"),
    ({"max_tree_chars": 0}, "max_tree_chars"),
])
def test_bad_policy_config_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="cache_aware"):
        make_policy("fastest")


@pytest.mark.parametrize("workers, message", [
    ((), "at least one worker"),
    (("http://a:1", "a:1/"), "more than once"),
    (("ftp://a:1",), "not a worker URL"),
    (("http://a:1/v1",), "without a path"),
    (("http://a:port",), "bad port"),
])
def test_bad_router_config_is_refused(workers: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(workers)


def test_routing_keys() -> None:
    assert routing_key("/v1/completions", {"prompt": "hello"}) == "hello"
    assert routing_key("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_key("/v1/completions", {"prompt": [1, 2]}) == "\x01\x02"
    # A salt's prompts are keyed apart from the same prompts unsalted or under another salt.
    salted = routing_key("/v1/completions", {"prompt": "hello", "cache_salt": "t1"})
    assert salted == "\x00t1\x00hello"
    assert salted != routing_key("/v1/completions", {"prompt": "hello", "cache_salt": "t2"})
    assert routing_key("/v1/completions", {"prompt": "hello", "cache_salt": ""}) == "hello"
    assert routing_key("/v1/completions", {"prompt": 5, "cache_salt": "t1"}) == ""
    # The model named (a LoRA adapter's KV is its own) keys apart too, before the salt.
    adapter = routing_key("/v1/completions", {"prompt": "hello", "cache_salt": "t1", "model": "sql"})
    assert adapter == "\x01sql\x01" + salted
    assert adapter != routing_key("/v1/completions", {"prompt": "hello", "cache_salt": "t1", "model": "base"})
    assert routing_key("/v1/completions", {"prompt": [[1, 2], [3]]}) == "\x01\x02"
    assert routing_key("/v1/embeddings", {"input": ["first", "second"]}) == "first"
    assert routing_key("/classify", {"input": ["first", "second"]}) == "first"
    assert routing_key("/v1/classify", {"input": [7, 8]}) == "\x07\x08"
    assert routing_key("/invocations", {"input": ["first"]}) == "first"
    assert routing_key("/invocations", {"prompt": "hello"}) == "hello"
    assert routing_key("/invocations", {"messages": [{"role": "user", "content": "hi"}]}) == "hi\n"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key("/v1/chat/completions", chat) == "be brief\nhi\n"
    assert routing_key("/v1/chat/completions", {"messages": "nope"}) == ""
    assert routing_key("/v1/completions", {}) == ""
    # A Responses request is keyed as the chat it amounts to (so both reach the same cache).
    assert routing_key("/v1/responses", {"instructions": "be brief", "input": "hi"}) == "be brief\nhi\n"
    items = [{"role": "system", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "function_call_output", "call_id": "c", "output": "x"}]
    assert routing_key("/v1/responses", {"input": items}) == "be brief\nhi\n"
    assert routing_key("/v1/responses", {"input": 5}) == ""
    # An Anthropic Messages request too: its system prompt (a string or text blocks), then its messages.
    assert routing_key("/v1/messages", {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}) \
        == "be brief\nhi\n"
    blocks = {"system": [{"type": "text", "text": "be brief"}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key("/v1/messages", blocks) == "be brief\nhi\n"
    assert routing_key("/v1/messages", {"messages": 5}) == ""
