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
  used only if the i - 1 before it were accepted, about ``acceptance ** i``, and it is
  offered only while that chance clears a bar set by what a draft costs against what
  an accepted token saves. A step of n tokens takes about ``F + n`` token-times (F,
  ``STEP_FIXED_TOKENS``: the step's fixed cost, streaming the weights, in units of
  one more token's cost), so one token of output costs ``(F + n) / n`` and a draft
  costs 1: the draft pays when its chance of use exceeds ``n / (F + n)``. At n = 1
  that is 11% (nearly free), at 4 a third, at 16 two thirds, at 64 nearly 90%. The bar is never below
  ``MIN_USE_CHANCE`` and adds the proposer's own cost per draft (``draft_cost``, in
  target steps: 0 for prompt lookup, about the share of the layers a draft model
  runs). A request below the bar for even one draft is offered one every
  ``PROBE_INTERVAL`` tokens, so that its estimate can recover; four times as seldom
  for a draft model, whose probe first catches its KV up over every token since the
  last one; never where the bar is out of reach (at or above 1: a draft model in a
  step so big that even certain acceptance would not pay for it); and no more once
  ``PROBE_EVIDENCE`` (64) draft tokens, engine-wide, have been accepted less often than the
  bar of a one-token step, the most favourable: then the proposer does not suit the
  target (the first half of a model not trained for early exit agrees with the whole
  on a few percent of tokens), and probing would only spend its forwards.

The room left in a step is shared out one draft at a time, round robin, so that no
request's long guess crowds out the others'.
"""

from __future__ import annotations

import math

from kvloom.config import SpeculativeConfig
from kvloom.request import Request

MIN_USE_CHANCE = 0.1  # the lowest chance of use a draft must have
# A decode step's fixed cost in units of one more token's. `kvloom bench steps` on AMD EPYC
# (SmolLM2-135M, bf16, context 300; docs/results/issue18/steps_amd.txt): 11.4 ms at 1 token,
# 14.1 at 4, 18.3 at 8, 26.7 at 16, 48.9 at 32, 105 at 64: about 10 ms fixed and 1 to 1.5 ms
# per token, so the break-even chance of a draft (marginal cost / cost per output token)
# is 0.10 at 1, 0.26 at 4, 0.72 at 16; F = 8 gives 0.11, 0.33, 0.67.
STEP_FIXED_TOKENS = 8.0
ACCEPTANCE_WEIGHT = 0.3  # weight of the latest verification in the moving estimate
PROBE_INTERVAL = 16  # output tokens between probes of a request that drafts do not pay for
MODEL_PROBE_INTERVAL = 4 * PROBE_INTERVAL  # the same with a proposer that costs steps
PROBE_EVIDENCE = 64  # draft tokens verified before the engine-wide rate may stop probes


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
        self.draft_cost = draft_cost
        self.probe_interval = PROBE_INTERVAL if draft_cost == 0 else MODEL_PROBE_INTERVAL
        # Engine-wide, cumulative: draft tokens verified and accepted, verifications.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification's outcome: the engine-wide counts (the scheduler's stats and
        the acceptance rate the rules read)."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1

    def acceptance_of(self, request: Request) -> float:
        """The request's estimate; before its first verification, the engine-wide rate
        once there is evidence (else 1.0: try the proposer)."""
        if request.num_draft_tokens or self.num_draft_tokens < PROBE_EVIDENCE:
            return request.draft_acceptance
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def probes_pay(self) -> bool:
        """Until there is evidence, yes; then whether drafts are accepted at least as
        often as a one-token step's bar asks."""
        return (self.num_draft_tokens < PROBE_EVIDENCE
                or self.num_accepted_tokens >= self.bar(1) * self.num_draft_tokens)

    def bar(self, num_step_tokens: int) -> float:
        """The chance of use a draft needs in a step of ``num_step_tokens`` other tokens."""
        batch_share = num_step_tokens / (STEP_FIXED_TOKENS + num_step_tokens)
        return max(MIN_USE_CHANCE, batch_share) + self.draft_cost

    def num_to_propose(self, request: Request, num_step_tokens: int) -> int:
        """Drafts worth proposing for ``request``'s next step, in a step of
        ``num_step_tokens`` other tokens (0: none)."""
        # The verified run plus the target's own token must stay within max_tokens.
        room = request.max_tokens - request.num_output_tokens - 1
        limit = self.config.num_speculative_tokens
        if self.config.adaptive:
            bar = self.bar(num_step_tokens)
            limit = min(limit, self._useful(self.acceptance_of(request), bar))
            if limit == 0 and bar < 1.0 and request.num_output_tokens % self.probe_interval == 0 \
                    and self.probes_pay:
                limit = 1
        return max(0, min(limit, room))

    @staticmethod
    def _useful(acceptance: float, bar: float) -> int:
        """The most drafts whose chance of use, ``acceptance ** i``, clears ``bar``."""
        if acceptance <= bar or bar >= 1.0:
            return 0
        if acceptance >= 1.0:
            return 1 << 30
        return int(math.log(bar) / math.log(acceptance))

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
