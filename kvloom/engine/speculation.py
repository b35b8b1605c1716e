"""How many draft tokens each request gets: the scheduler's side of speculative decoding.

Two rules, both in tokens:

* **The step rule** (``SpeculativeConfig.max_batched_tokens``): drafts join a step only
  while the step, decodes and prefill chunks included, stays within that many tokens.
  Below it a CPU step streams the weights once whatever the row count, so verifying a
  draft costs little; above it the step is compute-bound and a rejected draft costs
  as much as a decode. Large batches therefore run without speculation, with no
  proposer work either (``wants_drafts``).
* **The request rule** (``adaptive``): each request keeps ``draft_acceptance``, a
  moving estimate of the chance that one draft token is accepted. The i-th draft is
  used only if the i - 1 before it were accepted, about ``acceptance ** i``; a request
  is offered the i-th draft while that chance is at least ``MIN_USE_CHANCE`` plus the
  proposer's cost of one draft (``draft_cost``, in target steps: 0 for prompt
  lookup, about the share of the layers a draft model runs). A request below the bar
  for even one draft is offered one every ``PROBE_INTERVAL`` tokens, so that its
  estimate can recover.

The room left in a step is shared out one draft at a time, round robin, so that no
request's long guess crowds out the others'.
"""

from __future__ import annotations

import math

from kvloom.config import SpeculativeConfig
from kvloom.request import Request

MIN_USE_CHANCE = 0.1  # propose the i-th draft while acceptance ** i stays above this (+ its cost)
ACCEPTANCE_WEIGHT = 0.3  # weight of the latest verification in the moving estimate
PROBE_INTERVAL = 16  # output tokens between probes of a request that drafts do not pay for


def updated_acceptance(previous: float, num_drafts: int, num_accepted: int) -> float:
    """The moving per-token acceptance estimate after one verification: ``num_accepted``
    of ``num_drafts`` drafts were accepted (the first rejection ends the run, so the
    step saw ``num_accepted`` acceptances and one rejection unless all were accepted)."""
    rejections = 1 if num_accepted < num_drafts else 0
    observed = num_accepted / (num_accepted + rejections) if num_accepted + rejections else previous
    return (1.0 - ACCEPTANCE_WEIGHT) * previous + ACCEPTANCE_WEIGHT * observed


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig, draft_cost: float = 0.0) -> None:
        self.config = config
        self.bar = MIN_USE_CHANCE + draft_cost  # the chance of use a draft must have

    def num_to_propose(self, request: Request) -> int:
        """Drafts worth proposing for ``request``'s next step (0: none)."""
        # The verified run plus the target's own token must stay within max_tokens.
        room = request.max_tokens - request.num_output_tokens - 1
        limit = self.config.num_speculative_tokens
        if self.config.adaptive and request.draft_acceptance < 1.0:
            limit = min(limit, self._useful(request.draft_acceptance))
            if limit == 0 and request.num_output_tokens % PROBE_INTERVAL == 0:
                limit = 1
        return max(0, min(limit, room))

    def _useful(self, acceptance: float) -> int:
        """The most drafts whose chance of use, ``acceptance ** i``, clears the bar."""
        if acceptance <= self.bar or self.bar >= 1.0:
            return 0
        return int(math.log(self.bar) / math.log(acceptance))

    def wants_drafts(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` decodes leaves room for any draft."""
        return num_running < self.config.max_batched_tokens

    def share(self, wanted: list[int], room: int) -> list[int]:
        """Split ``room`` draft tokens among requests wanting ``wanted`` each, one at a
        time in turn (earlier requests first when it runs out)."""
        granted = [0] * len(wanted)
        while room > 0:
            progressed = False
            for index, want in enumerate(wanted):
                if room > 0 and granted[index] < want:
                    granted[index] += 1
                    room -= 1
                    progressed = True
            if not progressed:
                break
        return granted
