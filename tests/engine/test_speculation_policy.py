"""The scheduler's speculation rules against hand-computed values: the acceptance
estimate, the bar a draft must clear at each step size, how many drafts a request
is offered, and how a step's room is shared."""

from __future__ import annotations

import pytest

from kvloom.config import SpeculativeConfig
from kvloom.engine.speculation import SpeculationPolicy, updated_acceptance
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams


def request(acceptance: float = 1.0, max_tokens: int = 100, num_output: int = 5,
            verified: int = 4) -> Request:
    """A request whose estimate is ``acceptance`` after ``verified`` drafts."""
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for _ in range(num_output):
        r.append_output_token(7)
    r.draft_acceptance = acceptance
    r.num_draft_tokens = verified
    return r


def test_acceptance_estimate_moves_toward_each_verification() -> None:
    # 2 of 4 accepted: 2 acceptances and 1 rejection seen, 2/3; weight 0.3 on it.
    assert updated_acceptance(1.0, 4, 2) == pytest.approx(0.7 + 0.3 * 2 / 3)
    assert updated_acceptance(0.5, 3, 3) == pytest.approx(0.35 + 0.3)  # all accepted: 1.0 seen
    assert updated_acceptance(0.5, 2, 0) == pytest.approx(0.35)  # rejected at once: 0.0 seen


def test_the_bar_rises_with_the_step_and_the_proposers_cost() -> None:
    policy = SpeculationPolicy(SpeculativeConfig("ngram"))
    assert policy.bar(1) == pytest.approx(1 / 9)
    assert policy.bar(16) == pytest.approx(16 / 24)
    assert policy.bar(64) == pytest.approx(64 / 72)
    assert SpeculationPolicy(SpeculativeConfig("ngram"), draft_cost=0.25).bar(16) == pytest.approx(16 / 24 + 0.25)


def test_drafts_offered_follow_the_chance_of_use() -> None:
    policy = SpeculationPolicy(SpeculativeConfig("ngram", num_speculative_tokens=6))
    assert policy.num_to_propose(request(1.0), 1) == 6  # no rejection seen yet
    # 0.5 ** 3 = 0.125 clears the 1/9 bar, 0.5 ** 4 does not.
    assert policy.num_to_propose(request(0.5), 1) == 3
    # In a step of 16 tokens the bar is 2/3: 0.85 ** 2 = 0.72 clears it, 0.85 ** 3 not.
    assert policy.num_to_propose(request(0.85), 16) == 2
    # Below the bar: nothing, except a probe every 16 output tokens.
    assert policy.num_to_propose(request(0.3, num_output=5), 16) == 0
    assert policy.num_to_propose(request(0.3, num_output=16), 16) == 1
    # Never past max_tokens: the verified run plus the target's token must fit.
    assert policy.num_to_propose(request(1.0, max_tokens=8, num_output=5), 1) == 2
    assert policy.num_to_propose(request(1.0, max_tokens=6, num_output=5), 1) == 0
    # A draft model at half the target's cost: in a step of 16 (bar 2/3 + 1/2) even a
    # certain draft would not pay, so there are no probes either.
    costly = SpeculationPolicy(SpeculativeConfig("layer_skip", num_layers=2), draft_cost=0.5)
    assert costly.num_to_propose(request(1.0, num_output=64), 16) == 0
    assert costly.num_to_propose(request(0.05, num_output=64), 1) == 1  # a probe: the bar is 0.61
    assert costly.num_to_propose(request(0.05, num_output=16), 1) == 0  # probes are 64 tokens apart
    # Once 64 drafts engine-wide were accepted less often than the one-token bar (0.61
    # here), probes stop; a proposer that clears it keeps probing.
    costly.record(300, 30)
    assert costly.num_to_propose(request(0.05, num_output=64), 1) == 0
    # A new request starts from the engine-wide rate (10% here), not from 1.0.
    fresh = request(1.0, num_output=3, verified=0)
    assert costly.acceptance_of(fresh) == pytest.approx(0.1) and costly.num_to_propose(fresh, 1) == 0
    cheap = SpeculationPolicy(SpeculativeConfig("ngram"))
    cheap.record(300, 200)
    assert cheap.num_to_propose(request(0.05, num_output=16), 1) == 1
    fixed = SpeculationPolicy(SpeculativeConfig("ngram", num_speculative_tokens=6, adaptive=False))
    assert fixed.num_to_propose(request(0.01), 64) == 6


def test_room_is_shared_one_draft_at_a_time() -> None:
    policy = SpeculationPolicy(SpeculativeConfig("ngram"))
    assert policy.share([4, 4, 4], 5) == [2, 2, 1]
    assert policy.share([1, 4, 0], 10) == [1, 4, 0]
    assert policy.share([3, 3], 0) == [0, 0]
    assert policy.wants_drafts(31) and not policy.wants_drafts(32)
