"""The scheduler's decision record: what ran in each step, and why the rest did not.

Off by default: the scheduler then holds a ``NullTrace`` whose methods do nothing, so
the hot path pays one no-op call per step. ``--trace`` swaps in ``SchedulerTrace``, a
bounded ring buffer of ``StepRecord`` that `kvloom trace render` draws.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.batch import SchedulerOutput
    from kvloom.request import Request


class WaitReason(str, enum.Enum):
    """Why a waiting request was not admitted in a step."""

    TOKEN_BUDGET = "token budget"  # the step's max_num_batched_tokens was used up
    MAX_NUM_SEQS = "max_num_seqs"  # the running set is full
    NO_FREE_BLOCKS = "no free blocks"  # its first chunk's KV did not fit
    POLICY_ORDER = "policy order"  # queued behind a request that could not be admitted
    WATERMARK = "watermark"  # KV use above the watermark and its growth would not fit
    POOL_FULL = "pool full (preempted this step)"  # admission pauses after a preemption
    STATIC_BATCH = "static batch running"  # baseline mode admits only between batches
    PREFIX_IN_FLIGHT = "shared prefix in flight"  # its next blocks are being computed by another
    KV_STAGING_FULL = "KV staging full"  # prefill instance: decode instances have not pulled enough yet
    NO_FREE_STATE_SLOT = "no free state slot"  # a state-space model's slots are all held by running requests
    LORA_SLOT_BUSY = "LoRA slots busy"  # every adapter slot holds an adapter of running requests


@dataclass(slots=True)
class ScheduledEntry:
    request_id: str
    kind: str  # "prefill" | "decode"
    num_tokens: int  # drafts included
    num_blocks: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in this entry
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(slots=True)
class StepRecord:
    step: int
    scheduled: list[ScheduledEntry]
    waiting: list[tuple[str, str]]  # (request id, WaitReason value)
    preempted: list[tuple[str, str]]  # (request id, reason)
    finished: list[tuple[str, str]] = field(default_factory=list)  # (request id, finish reason)
    num_free_blocks: int = 0
    num_batched_tokens: int = 0


class NullTrace:
    """Tracing disabled: every hook is a no-op."""

    enabled = False

    def record_step(self, output: SchedulerOutput, waiting: list[Request],
                    blocked: Request | None, reason: WaitReason | None,
                    preempt_reasons: dict[str, str], num_free_blocks: int,
                    deferred: dict[Request, WaitReason]) -> None:
        pass

    def record_finish(self, step: int, request: Request) -> None:
        pass

    def record_verified(self, step: int, request: Request, num_accepted: int) -> None:
        pass


class SchedulerTrace(NullTrace):
    enabled = True

    def __init__(self, capacity: int = 10_000) -> None:
        self.records: deque[StepRecord] = deque(maxlen=capacity)

    def record_step(self, output: SchedulerOutput, waiting: list[Request],
                    blocked: Request | None, reason: WaitReason | None,
                    preempt_reasons: dict[str, str], num_free_blocks: int,
                    deferred: dict[Request, WaitReason]) -> None:
        scheduled = [
            ScheduledEntry(item.request.request_id, "prefill" if item.is_prefill else "decode",
                           item.num_new_tokens, len(item.request.block_ids), len(item.draft_token_ids))
            for item in output.scheduled
        ]
        # The request admission stopped at gets the reason; those behind it wait on it,
        # unless the reason holds for everyone (budget, seat limit, full pool).
        shared = reason in (WaitReason.TOKEN_BUDGET, WaitReason.MAX_NUM_SEQS,
                            WaitReason.POOL_FULL, WaitReason.STATIC_BATCH)
        waits = []
        for request in waiting:
            if request in deferred:  # passed over: a shared prefix in flight, a busy adapter slot
                waits.append((request.request_id, deferred[request].value))
            elif request is blocked or shared:
                waits.append((request.request_id, (reason or WaitReason.POLICY_ORDER).value))
            else:
                waits.append((request.request_id, WaitReason.POLICY_ORDER.value))
        self.records.append(StepRecord(
            step=output.step, scheduled=scheduled, waiting=waits,
            preempted=[(r.request_id, preempt_reasons.get(r.request_id, "")) for r in output.preempted],
            num_free_blocks=num_free_blocks, num_batched_tokens=output.num_batched_tokens,
        ))

    def record_finish(self, step: int, request: Request) -> None:
        if self.records and self.records[-1].step == step:
            self.records[-1].finished.append((request.request_id, request.status.value))

    def record_verified(self, step: int, request: Request, num_accepted: int) -> None:
        if self.records and self.records[-1].step == step:
            for entry in self.records[-1].scheduled:
                if entry.request_id == request.request_id:
                    entry.num_accepted_tokens = num_accepted

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "steps": [asdict(record) for record in self.records]}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
