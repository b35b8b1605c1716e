"""Beam search's rounds (engine/beam_search.py) on candidates given by hand, against
scores computed by hand; the model-backed runs are in tests/e2e/test_beam_search_default_model.py."""

from __future__ import annotations

import pytest

from kvloom.engine.beam_search import BeamSearch, BeamSearchParams

EOS = 2
PROMPT = [11, 12, 13]  # three tokens: a beam's length counts them (vLLM's rule)


def two_rounds(length_penalty: float) -> BeamSearch:
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty), [EOS])
    assert search.prompts() == [PROMPT]
    # Round 1: EOS finishes its beam; the two best of the rest live on (7 does not).
    search.advance([[(5, -0.1), (6, -0.5), (EOS, -1.0), (7, -2.0)]])
    assert [b.token_ids for b in search.live] == [[5], [6]]
    assert [b.token_ids for b in search.finished] == [[EOS]]
    assert search.prompts() == [PROMPT + [5], PROMPT + [6]]
    # Round 2: [5, 8] -0.3, [6, 9] -0.55 and [6, 10] -1.5 compete; [5, EOS] -0.4 finishes.
    search.advance([[(8, -0.2), (EOS, -0.3)], [(9, -0.05), (10, -1.0)]])
    assert [b.token_ids for b in search.live] == [[5, 8], [6, 9]]
    assert search.done and all(b.finish_reason == "length" for b in search.live)
    return search


@pytest.mark.parametrize("length_penalty, expected", [
    # score = cum / (3 + generated - a final EOS) ** penalty:
    # [EOS] -1/3 = -0.33, [5, EOS] -0.4/4 = -0.1, [5, 8] -0.3/5 = -0.06, [6, 9] -0.55/5 = -0.11
    (1.0, [[5, 8], [5, EOS]]),
    # the sums alone: -1.0, -0.4, -0.3, -0.55
    (0.0, [[5, 8], [5, EOS]]),
    # cubes: -1/27 = -0.037, -0.4/64 = -0.0063, -0.3/125 = -0.0024, -0.55/125 = -0.0044
    (3.0, [[5, 8], [6, 9]]),
])
def test_the_best_beams_by_vllms_score(length_penalty: float, expected: list[list[int]]) -> None:
    best = two_rounds(length_penalty).best()
    assert [b.token_ids for b in best] == expected
    by_tokens = {tuple(b.token_ids): b for b in best}
    assert by_tokens[(5, 8)].cum_logprob == pytest.approx(-0.3) and by_tokens[(5, 8)].logprobs == [-0.1, -0.2]
    if (5, EOS) in by_tokens:
        assert by_tokens[(5, EOS)].finish_reason == "stop"


def test_ignore_eos_makes_eos_a_token_like_any_other() -> None:
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), [EOS])
    search.advance([[(EOS, -0.1), (6, -0.5), (7, -0.7)]])
    assert [b.token_ids for b in search.best()] == [[EOS], [6]] and not search.finished


def test_a_search_whose_beams_all_finish_ends_early() -> None:
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=5), [EOS, 3])
    search.advance([[(EOS, -0.2), (3, -0.4)]])  # both EOS tokens
    assert search.done and search.rounds == 1
    assert [(b.token_ids, b.finish_reason) for b in search.best()] == [([EOS], "stop"), ([3], "stop")]
    with pytest.raises(RuntimeError, match="has ended"):
        search.advance([])


def test_bad_params_and_rounds_are_named() -> None:
    for kwargs, message in (({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer >= 1, got 0"),
                            ({"beam_width": 65, "max_tokens": 4}, "beam_width must be at most 64"),
                            ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
                            ({"beam_width": 2, "max_tokens": True}, "max_tokens must be an integer"),
                            ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")},
                             r"length_penalty must be a number in \[-10, 10\]"),
                            ({"beam_width": 2, "max_tokens": 4, "length_penalty": -11},
                             r"length_penalty must be a number in \[-10, 10\], got -11")):
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="a prompt of at least one token"):
        BeamSearch([], BeamSearchParams(2, 4), [EOS])
    search = BeamSearch(PROMPT, BeamSearchParams(2, 4), [EOS])
    with pytest.raises(ValueError, match="candidates for 2 beams, 1 are live"):
        search.advance([[(5, -0.1)], [(6, -0.2)]])
    params = BeamSearchParams(3, 4).round_params()
    assert (params.max_tokens, params.temperature, params.logprobs, params.ignore_eos) == (1, 0.0, 6, True)
