"""The router's prefix tree against a naive reference: every text sent to each worker."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloom.router.prefix_tree import EVICT_TO, PrefixTree

WORKERS = ("http://a", "http://b", "http://c")
# A small alphabet makes shared prefixes, splits and partial-edge matches common.
texts = st.text(alphabet="abc\u00e9\U0001f600", max_size=12)


def naive_match(sent: dict[str, list[str]], text: str) -> dict[str, int]:
    result = {}
    for worker, items in sent.items():
        best = max((len(os.path.commonprefix([item, text])) for item in items), default=0)
        if best:
            result[worker] = best
    return result


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS)), max_size=30), st.lists(texts, max_size=8))
def test_match_equals_the_naive_reference_without_eviction(inserts: list[tuple[str, str]],
                                                            queries: list[str]) -> None:
    tree = PrefixTree(max_chars_per_worker=10_000)
    sent: dict[str, list[str]] = {}
    for text, worker in inserts:
        tree.insert(text, worker)
        sent.setdefault(worker, []).append(text)
        tree.check_integrity()
    for query in queries + [t for t, _ in inserts]:
        assert tree.match(query) == naive_match(sent, query)
    # A worker holds, in characters, exactly the distinct prefixes it was sent.
    for worker, items in sent.items():
        prefixes = {item[:i] for item in items for i in range(1, len(item) + 1)}
        assert tree.chars.get(worker, 0) == len(prefixes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS)), max_size=30), st.sampled_from(WORKERS))
def test_remove_worker_forgets_it_and_keeps_the_others(inserts: list[tuple[str, str]], gone: str) -> None:
    tree = PrefixTree(max_chars_per_worker=10_000)
    sent: dict[str, list[str]] = {}
    for text, worker in inserts:
        tree.insert(text, worker)
        sent.setdefault(worker, []).append(text)
    tree.remove_worker(gone)
    tree.check_integrity()
    sent.pop(gone, None)
    for text, _ in inserts:
        assert tree.match(text) == naive_match(sent, text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS)), min_size=1, max_size=40),
       st.integers(min_value=1, max_value=20))
def test_eviction_bounds_each_worker_and_keeps_the_latest_text(inserts: list[tuple[str, str]],
                                                               bound: int) -> None:
    tree = PrefixTree(max_chars_per_worker=bound)
    for text, worker in inserts:
        tree.insert(text, worker)
        tree.check_integrity()  # includes chars[worker] <= bound
        # Eviction forgets the least recently used leaves first: the text just sent
        # survives whole unless it alone is over what eviction keeps.
        if len(text) <= int(bound * EVICT_TO):
            assert tree.match(text).get(worker, 0) == len(text)
    # Eviction only forgets: every match is one the naive reference allows.
    sent: dict[str, list[str]] = {}
    for text, worker in inserts:
        sent.setdefault(worker, []).append(text)
    for text, _ in inserts:
        reference = naive_match(sent, text)
        for worker, length in tree.match(text).items():
            assert length <= reference.get(worker, 0)


def test_lru_leaf_goes_first() -> None:
    tree = PrefixTree(max_chars_per_worker=14)  # evicts down to int(14 * 0.9) = 12
    tree.insert("sys-old", "w")   # 7 chars
    tree.insert("sys-new", "w")   # +3 chars ("new") = 10
    tree.insert("sys-new!", "w")  # +1 = 11
    tree.insert("sys-old", "w")   # touch: old is now the most recent
    tree.insert("other", "w")     # +5 = 16 > 14: forget LRU leaves down to 12
    tree.check_integrity()
    assert tree.match("sys-old") == {"w": 7}
    assert tree.match("other") == {"w": 5}
    assert tree.match("sys-new!") == {"w": 4}  # "new" and "!" were the least recently used
    assert tree.chars["w"] == 12


def test_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_chars_per_worker"):
        PrefixTree(0)
