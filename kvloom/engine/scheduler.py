"""The iteration-level scheduler. It thinks in tokens, not phases.

Every request has ``num_computed_tokens`` that catches up with ``num_tokens`` under a
per-step token budget. Decode (one token), a prefill chunk, a prefix-cache hit
(tokens counted as computed) and recompute after preemption are one code path.

Each step: running requests first (in policy order); when one cannot get a block,
the policy picks a victim among those not yet scheduled and it is preempted (blocks
freed, back to the head of the waiting queue). Then waiting requests are admitted in
policy order while budget, ``max_num_seqs``, blocks and (for a state-space model)
state slots last. A request on a LoRA adapter also needs the adapter's slot: where every
slot holds an adapter of running requests it waits (as vLLM's), others go on past it,
and later requests on adapters queue behind it, so that a busy slot drains rather than
being held forever by newcomers.

A prefix hit that ends inside a cached block has that block copied into the request's
first private block before the step's forward (``SchedulerOutput.block_copies``).

For a state-space model with prefix caching, a hit also restores the mixers' state
from its checkpoint, and a chunk ends at each checkpoint the KV cache manager plans
for the request, whose state the runner then saves (``SchedulerOutput.state_*``).

The scheduler is the one writer of a request's state: its status, progress
(``num_computed_tokens``, ``num_pending_tokens``), output tokens, stop reason and
error (``block_ids`` are the KV cache manager's). ``advance`` is where a launched
step's progress enters it, ``commit`` where its sampled tokens do (``update``: both).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from kvloom.batch import BlockCopy, RunnerOutput, ScheduledRequest, SchedulerOutput, StateCopy
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.prefix_cache import PrefixMatch
from kvloom.cache.state_pool import NoStatePool, StatePool
from kvloom.config import SchedulerConfig
from kvloom.engine.adapter_slots import AdapterSlots, NoAdapterSlots
from kvloom.engine.admission import AdmissionLimits, RequestRejected
from kvloom.engine.policy import SchedulingPolicy
from kvloom.engine.speculation import SpeculationPolicy, updated_acceptance
from kvloom.engine.stop import StopChecker
from kvloom.engine.trace import NullTrace, SchedulerTrace, WaitReason
from kvloom.kv_spec import KVExport
from kvloom.kv_transfer.connector import KVTransfer
from kvloom.kv_transfer.staging import StagingError
from kvloom.request import Request, RequestError, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """What one step did to a request that produced tokens or ended: it appended the
    last ``num_new_tokens`` of its output tokens (possibly 0: it failed)."""

    request: Request
    index: int  # its entry in SchedulerOutput.scheduled and RunnerOutput
    num_new_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: SchedulingPolicy,
                 limits: AdmissionLimits, stops: StopChecker | None = None,
                 speculation: SpeculationPolicy | None = None, kv_transfer: KVTransfer | None = None,
                 state: StatePool | None = None, adapters: AdapterSlots | None = None) -> None:
        self.config = config
        self.kv = kv
        # A state-space model's state slots, one per running request (the null pool otherwise).
        self.state = state if state is not None else NoStatePool()
        # The LoRA adapters' slots, one held by each running request on an adapter.
        self.adapters = adapters if adapters is not None else NoAdapterSlots()
        self.policy = policy
        self.limits = limits
        self.stops = stops if stops is not None else StopChecker()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Admitted with blocks, their prompt's KV arriving from a prefill instance; they
        # join `running` when the pull is reported (an aborted one is freed only then).
        self.receiving: list[Request] = []
        # Prefill/decode disaggregation (kv_transfer/connector.py); the null one: nothing moves.
        self.kv_transfer = kv_transfer if kv_transfer is not None else KVTransfer()
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        # Cumulative: tokens prefill chunks computed (recompute included), tokens appended.
        self.num_prefill_tokens = 0
        self.num_generated_tokens = 0
        self.num_starvation_promotions = 0
        # Prefix-cache hit rate in tokens, counted once per request at first admission.
        self.num_queried_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_block_copies = 0  # hits that ended inside a cached block (its copies)
        # Passed over this step, and why (a shared prefix in flight, a busy adapter slot).
        self._deferred: dict[Request, WaitReason] = {}
        self._state_restores: list[StateCopy] = []  # this step's (SchedulerOutput.state_restores)
        self._state_saves: list[StateCopy] = []
        self._block_copies: list[BlockCopy] = []  # this step's (SchedulerOutput.block_copies)
        self._ended: list[Request] = []  # ended with an error while scheduling, not yet reported (take_ended)
        self.trace: NullTrace = SchedulerTrace(config.trace_capacity) if config.trace else NullTrace()
        self._arrivals = 0
        # A chunk cap of 0 means "the whole budget".
        self._chunk_cap = config.long_prefill_threshold or config.max_num_batched_tokens
        # Speculative decoding's rules and its engine-wide counts (None when it is off).
        self.speculation = speculation

    # ---- lifecycle -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected if it could never be served."""
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use", code="duplicate_request_id")
        limits = self.limits
        limits.check_prompt(request.num_prompt_tokens)
        limits.check_token_ids(request.prompt_token_ids, "prompt")
        limits.check_token_ids(request.sampling_params.stop_token_ids, "stop_token_ids")
        limits.check_logprobs(request.sampling_params.logprobs, "logprobs")
        limits.check_logprobs(request.sampling_params.prompt_logprobs, "prompt_logprobs")
        limits.check_token_ids(request.sampling_params.logit_bias or (), "logit_bias")
        limits.check_token_ids(request.sampling_params.allowed_token_ids or (), "allowed_token_ids")
        for word in request.sampling_params.bad_words_token_ids or ():
            limits.check_token_ids(word, "bad_words_token_ids")
        budget = request.sampling_params.thinking_budget
        limits.check_token_ids([budget.end_token_id] if budget is not None else (), "thinking_budget.end_token_id")
        if budget is not None and budget.start_token_id is not None:
            limits.check_token_ids([budget.start_token_id], "thinking_budget.start_token_id")
        limits.check_fits_pool(request.num_prompt_tokens, request.max_tokens)
        request.arrival_index = self._arrivals
        request.timeline.arrival_step = self.step_count
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus,
                       stop_reason: int | str | None = None, error: RequestError | None = None) -> None:
        """End a request now: its blocks return to the pool (or the prefix cache).
        ``error`` goes with status FINISHED_ERROR."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request not in self.receiving:  # else the transfer thread may still write its blocks
            self._free(request)
        self.kv_transfer.finish(request)
        request.status = status
        request.stop_reason = stop_reason
        request.error = error
        request.timeline.finished_time = time.monotonic()
        request.timeline.finished_step = self.step_count
        del self.requests[request.request_id]
        self.trace.record_finish(self.step_count, request)

    def take_ended(self) -> list[Request]:
        """The requests that ``schedule`` ended with an error since the last call (their
        outputs are the engine's to make)."""
        ended, self._ended = self._ended, []
        return ended

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # Speculative decoding, cumulative (kept by the speculation policy; 0 when it is off):
    # drafts verified, drafts accepted, verifications (an entry with at least one draft).
    @property
    def num_draft_tokens(self) -> int:
        return self.speculation.num_draft_tokens if self.speculation else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.speculation.num_accepted_tokens if self.speculation else 0

    @property
    def num_verifications(self) -> int:
        return self.speculation.num_verifications if self.speculation else 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.receiving)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        preempt_reasons: dict[str, str] = {}
        self._take_received()
        self._state_restores, self._state_saves, self._block_copies = [], [], []

        pending = list(self.policy.order_running(self.running))
        while pending and budget > 0:
            request = pending.pop(0)
            if request.num_pending_tokens and request.num_output_tokens + 1 >= request.max_tokens:
                continue  # its pending token is its last (overlap scheduling): nothing to compute
            num_new = self._num_new_tokens(request.num_tokens_with_pending - request.num_computed_tokens, budget,
                                           first=not scheduled)
            num_new = self.kv.tokens_to_checkpoint(request, num_new)
            if num_new <= 0:
                continue
            while not self.kv.allocate_slots(request, num_new):
                # Candidates in admission order: the request itself, then those after it.
                victim = self.policy.pick_victim([request] + pending)
                self._preempt(victim)
                preempted.append(victim)
                preempt_reasons[victim.request_id] = f"no free blocks for {request.request_id}"
                if victim is request:
                    break
                pending.remove(victim)
            else:
                self._save_state_at_checkpoint(request, num_new)
                scheduled.append(ScheduledRequest.of(request, request.num_computed_tokens, num_new))
                budget -= num_new

        # Admitting right after a preemption would only thrash: the pool is full.
        self._deferred = {}
        blocked, reason = (None, WaitReason.POOL_FULL) if preempted else \
            self._admit_waiting(budget, scheduled)
        if self.speculation is not None:
            self._add_drafts(scheduled)
        output = SchedulerOutput(self.step_count, scheduled, preempted, self._state_restores, self._state_saves,
                                 self._block_copies)
        self.trace.record_step(output, self.waiting, blocked, reason, preempt_reasons,
                               self.kv.pool.num_free_blocks, self._deferred)
        return output

    def _add_drafts(self, scheduled: list[ScheduledRequest]) -> None:
        """Extend the step's decodes by their requests' drafts, in the room the step
        rule leaves (engine/speculation.py); a draft never preempts anyone: a request
        whose drafts' slots do not fit goes without. Unused drafts are dropped."""
        assert self.speculation is not None
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        room = min(self.config.max_num_batched_tokens, self.speculation.config.max_batched_tokens) - num_tokens
        entries = [index for index, item in enumerate(scheduled)
                   if item.samples and item.request.draft_token_ids]
        wanted = [min(len(scheduled[i].request.draft_token_ids),
                      self.speculation.num_to_propose(scheduled[i].request, num_tokens)) for i in entries]
        for index, count in zip(entries, self.speculation.share(wanted, room), strict=True):
            item = scheduled[index]
            request = item.request
            drafts = tuple(request.draft_token_ids[:count])
            if count and self.kv.allocate_slots(request, item.num_new_tokens + count):
                scheduled[index] = ScheduledRequest.of(request, item.start, item.num_new_tokens + count,
                                                       drafts)
        for request in self.running:
            request.draft_token_ids = []

    def draft_candidates(self) -> list[tuple[Request, int]]:
        """Requests whose next step is a decode that drafts could extend, with how many
        drafts each is worth; none when the batch is too big for any (the step rule)."""
        if self.speculation is None or not self.speculation.wants_drafts(len(self.running)):
            return []
        candidates = []
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            # The next step's other tokens: about one decode per running request.
            count = self.speculation.num_to_propose(request, len(self.running))
            if count > 0:
                candidates.append((request, count))
        return candidates

    def set_draft_tokens(self, drafts: dict[Request, list[int]]) -> None:
        """Keep the proposer's guesses for the requests' next step."""
        for request, token_ids in drafts.items():
            if not request.is_finished:
                request.draft_token_ids = list(token_ids)

    def _num_new_tokens(self, remaining: int, budget: int, first: bool) -> int:
        """How many of a request's ``remaining`` uncomputed tokens this step computes."""
        if not self.config.enable_chunked_prefill:
            # Unchunked: the whole remainder at once; only the first entry of a step may
            # exceed the budget, so that a prompt longer than the budget still runs.
            return remaining if (remaining <= budget or first) else 0
        return min(remaining, budget, self._chunk_cap)

    def _admission_order(self) -> list[Request]:
        """Policy order, except that requests waiting past the starvation bound go first."""
        ordered = self.policy.order_waiting(self.waiting, self.kv)
        max_steps, max_seconds = self.config.max_wait_steps, self.config.max_wait_seconds
        if not (max_steps or max_seconds):
            return ordered
        now = time.monotonic()
        starving = [r for r in ordered
                    if (max_steps and self.step_count - r.timeline.arrival_step > max_steps)
                    or (max_seconds and now - r.arrival_time > max_seconds)]
        if not starving:
            return ordered
        starving.sort(key=lambda r: r.arrival_index)
        self.num_starvation_promotions += len(starving)
        promoted = set(starving)
        return starving + [r for r in ordered if r not in promoted]

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]
                       ) -> tuple[Request | None, WaitReason | None]:
        """Admit waiting requests while they fit; returns where and why admission stopped."""
        if not self.waiting:
            return None, None
        in_flight = self.kv.prefixes_in_flight(self.running)
        adapters_busy = False  # a request waits for an adapter slot: later ones on adapters queue behind it
        for request in list(self._admission_order()):  # a copy: admission edits the queue
            if budget <= 0:
                return None, WaitReason.TOKEN_BUDGET
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                return None, WaitReason.MAX_NUM_SEQS
            if request.lora_key is not None and not self._holds_adapter(request, adapters_busy):
                adapters_busy = adapters_busy or not request.is_finished
                continue
            # From here on the request holds its adapter's slot: let go where it is not admitted.
            prefix = self._cached_prefix(request)
            num_imported = self.kv_transfer.importable(request, prefix.num_tokens)
            if num_imported:
                prefix = dataclasses.replace(prefix, partial=None)  # a pull fills whole blocks
                # Like a hit: blocks for the whole prompt now, its KV pulled while others run.
                if not self.kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix):
                    self.adapters.free(request)
                    return request, WaitReason.NO_FREE_BLOCKS
                self._start_receiving(request, prefix, num_imported)
                continue
            if prefix.shareable and in_flight.covers_next_block(request, prefix.num_tokens):
                # A running request is computing this request's next blocks right now:
                # waiting for them turns recomputation into a cache hit.
                self.adapters.free(request)
                self._deferred[request] = WaitReason.PREFIX_IN_FLIGHT
                continue
            num_new = self._num_new_tokens(request.num_tokens - prefix.num_hit_tokens, budget,
                                           first=not scheduled)
            refusal = WaitReason.TOKEN_BUDGET if num_new <= 0 else \
                self.policy.refuse_admission(request, self.kv)
            if refusal is None and not self.state.has_free_slot:
                refusal = WaitReason.NO_FREE_STATE_SLOT
            if refusal is None and not self.kv_transfer.reserve(request):
                refusal = WaitReason.KV_STAGING_FULL
            if refusal is None:
                attached = self._allocate_hit(request, num_new, prefix)
                if attached is None:
                    refusal = WaitReason.NO_FREE_BLOCKS
                else:
                    prefix = attached
            if refusal is not None:
                self.adapters.free(request)
                return request, refusal
            request.num_computed_tokens = prefix.num_hit_tokens  # the hit counts as computed
            copy = self.kv.block_copy(request)
            if copy is not None:  # the hit ends inside a cached block: copied before the forward
                self._block_copies.append(copy)
                self.num_block_copies += 1
            self.state.allocate(request)
            self._restore_state(request, prefix)
            self.waiting.remove(request)
            self.running.append(request)
            self._mark_admitted(request, prefix)
            self.kv_transfer.skip_import(request)  # staged KV it did not need (cached here)
            in_flight.add(request)
            num_new = self.kv.tokens_to_checkpoint(request, num_new)
            self._save_state_at_checkpoint(request, num_new)
            scheduled.append(ScheduledRequest.of(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return None, None

    def _holds_adapter(self, request: Request, queue_behind: bool) -> bool:
        """Whether ``request`` holds its LoRA adapter's slot, taking it now if there is
        one to be had and no earlier request waits for a slot (``queue_behind``: a
        reference taken on a busy slot could keep it from ever draining). Passed over
        otherwise; a request whose adapter was unloaded while it waited ends with that error."""
        if not queue_behind:
            try:
                if self.adapters.hold(request):
                    return True
            except ValueError as error:
                logger.error("request %s: %s", request.request_id, error)
                self.finish_request(request, RequestStatus.FINISHED_ERROR,
                                    error=RequestError(str(error), caused_by_request=True))
                self._ended.append(request)
                return False
        self._deferred[request] = WaitReason.LORA_SLOT_BUSY
        return False

    def _allocate_hit(self, request: Request, num_new: int, prefix: PrefixMatch) -> PrefixMatch | None:
        """Blocks for ``num_new`` tokens past the hit, and the hit attached; returns the hit
        as attached, None if the blocks are not to be had. A partial block is worth a copy,
        never a wait: its source's node is locked until the copy, which takes that node's
        blocks out of what eviction can free, so where only that stands in the way the
        request goes without it (and computes those tokens)."""
        if self.kv.allocate_slots(request, num_new, prefix):
            return prefix
        if prefix.partial is None:
            return None
        reason = (f"prefix hit of {prefix.num_tokens} tokens; the {prefix.partial.num_tokens} after them "
                  "are computed: the pool had no room to copy the cached block that holds them")
        whole = dataclasses.replace(prefix, partial=None, miss_reason=reason)
        return whole if self.kv.allocate_slots(request, num_new, whole) else None

    def _restore_state(self, request: Request, prefix: PrefixMatch) -> None:
        """A hit of a cache that keeps states: the mixers start from the checkpoint (its
        node is locked by the request, so the slot is not reused before the copy), and
        the KV cache manager plans where this request saves its own."""
        if prefix.state_slot is not None and prefix.num_tokens:
            assert request.state_slot is not None
            self._state_restores.append(StateCopy(prefix.state_slot, request.state_slot))
        self.kv.plan_checkpoints(request, prefix)

    def _save_state_at_checkpoint(self, request: Request, num_new: int) -> None:
        """A chunk that ends at a planned checkpoint saves the state after it."""
        slot = self.kv.reserve_checkpoint(request, request.num_computed_tokens + num_new)
        if slot is not None:
            assert request.state_slot is not None
            self._state_saves.append(StateCopy(request.state_slot, slot))

    def _start_receiving(self, request: Request, prefix: PrefixMatch, num_imported: int) -> None:
        request.num_computed_tokens = prefix.num_tokens
        self.waiting.remove(request)
        self._mark_admitted(request, prefix)
        request.status = RequestStatus.RECEIVING
        self.receiving.append(request)
        self.kv_transfer.start_import(request, prefix.num_tokens, num_imported)

    def _take_received(self) -> None:
        """Requests whose pull finished join the running batch: their KV counts as
        computed (and enters the prefix cache), or, if it failed, they compute it here."""
        for result in self.kv_transfer.poll():
            request = result.request
            self.receiving.remove(request)
            if request.is_finished:  # aborted while its KV arrived: only now are its blocks free
                self._free(request)
                continue
            if result.num_tokens:
                request.num_computed_tokens = result.num_tokens
                self.kv.cache_computed_blocks(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _cached_prefix(self, request: Request) -> PrefixMatch:
        """The request's prefix-cache hit; none for a request that wants its prompt's
        logprobs or a vector per prompt token (every prompt position must be computed)."""
        params = request.sampling_params
        if request.pools_every_token:
            return PrefixMatch(miss_reason=f"pooling {params.pooling} reads every prompt position", shareable=False)
        if params.prompt_logprobs is not None:
            if not params.prompt_logprobs_start:
                return PrefixMatch(miss_reason="prompt_logprobs needs the whole prompt computed", shareable=False)
            # Token i's logprob comes from position i - 1's hidden state: compute from there.
            return self.kv.match_prefix(request, max_tokens=params.prompt_logprobs_start - 1)
        return self.kv.match_prefix(request)

    def _mark_admitted(self, request: Request, prefix: PrefixMatch | None) -> None:
        timeline = request.timeline
        if request.status is RequestStatus.PREEMPTED:
            timeline.resumed_steps.append(self.step_count)
        else:
            request.num_cached_tokens = prefix.num_hit_tokens if prefix else 0
            self.num_queried_prompt_tokens += request.num_prompt_tokens
            self.num_cached_prompt_tokens += request.num_cached_tokens
            request.cache_miss_reason = prefix.miss_reason if prefix else "static batching"
            timeline.first_scheduled_time = time.monotonic()
            timeline.first_scheduled_step = self.step_count
        request.status = RequestStatus.RUNNING

    def _preempt(self, request: Request) -> None:
        """Free the request's KV and requeue it at the head; it recomputes on resume."""
        self.running.remove(request)
        self._free(request)
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.timeline.preempted_steps.append(self.step_count)
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def _free(self, request: Request) -> None:
        """Release the request's KV (computed full blocks stay cached) and its state slot:
        nothing is computed."""
        self.kv.free(request)
        self.state.free(request)
        self.adapters.free(request)
        request.num_computed_tokens = 0

    # ---- once the step is launched, and after the forward pass ----------------------
    def advance(self, output: SchedulerOutput) -> None:
        """A launched step's progress: its known tokens count as computed (the device
        computes them before anything launched later reads them) and an entry that
        samples leaves its request a pending token until ``commit``. Called after the
        previous step's ``commit`` and before this one's, so the pending token of one
        step is appended before the next step counts it as computed."""
        for item in output.scheduled:
            request = item.request
            if request.is_finished:  # aborted, or stopped by the previous step's tokens
                continue
            assert request.num_pending_tokens == 0, request
            # Drafts count as computed only once verified (commit).
            request.num_computed_tokens += item.num_known_tokens
            if item.is_prefill:
                request.timeline.prefill_chunks.append((output.step, item.num_new_tokens))
                self.num_prefill_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if item.samples:
                request.num_pending_tokens = 1

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[StepUpdate]:
        """A step that ran to its end before the next was scheduled: ``advance`` and
        ``commit`` at once."""
        self.advance(output)
        return self.commit(output, result)

    def commit(self, output: SchedulerOutput, result: RunnerOutput) -> list[StepUpdate]:
        """Enter an advanced step's results: each entry's sampled token and any forced
        ones (jump-forward, left uncomputed so the next step computes them as a chunk)
        are appended one by one until one stops the request; a request the runner
        reports failed finishes with its error. Returns, in schedule order, an update
        for every request that appended tokens or failed."""
        now = time.monotonic()
        updates: list[StepUpdate] = []
        for index, item in enumerate(output.scheduled):
            request = item.request
            if request.is_finished:  # aborted while the step ran, or stopped by the step before
                continue
            if item.samples:
                request.num_pending_tokens = 0
            error = result.failed.get(request.request_id)
            if error is not None:
                self.finish_request(request, RequestStatus.FINISHED_ERROR, error=error)
                updates.append(StepUpdate(request, index, 0))
                continue
            if isinstance(request.kv_transfer, KVExport) and not request.output_token_ids \
                    and request.num_computed_tokens >= request.num_prompt_tokens and not self._export(request):
                updates.append(StepUpdate(request, index, 0))
                continue
            token_ids = result.new_token_ids(index)
            if not token_ids:
                continue
            timeline = request.timeline
            if timeline.first_token_time is None:
                timeline.first_token_time, timeline.first_token_step = now, output.step
            timeline.last_token_time = now
            appended = self._append(request, token_ids)
            self.num_generated_tokens += appended
            if item.draft_token_ids:
                self._verified(request, output.step, len(item.draft_token_ids),
                               result.num_accepted(index), appended)
            updates.append(StepUpdate(request, index, appended))
        return updates

    def _export(self, request: Request) -> bool:
        """Prefill instance: the prompt is computed; stage its KV before anything can
        free its blocks. A failure is this request's alone."""
        try:
            self.kv_transfer.export(request)
        except StagingError as error:
            logger.error("request %s: %s", request.request_id, error)
            self.finish_request(request, RequestStatus.FINISHED_ERROR, error=RequestError(str(error)))
            return False
        return True

    def _verified(self, request: Request, step: int, num_drafts: int, num_accepted: int,
                  num_appended: int) -> None:
        """Account a verification; KV rollback: the accepted drafts' KV is the request's
        (the tokens appended agree with them), the rejected ones' slots are dropped and
        blocks that held only those go back to the pool. The radix cache only ever sees
        computed, hence verified, tokens."""
        assert self.speculation is not None
        previous = self.speculation.acceptance_of(request)
        self.speculation.record(num_drafts, num_accepted)
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        request.draft_acceptance = updated_acceptance(previous, num_drafts, num_accepted)
        self.trace.record_verified(step, request, num_accepted)
        if not request.is_finished:  # a finished request's blocks are already freed
            # Tokens appended before a stop agree with the drafts up to num_accepted.
            request.num_computed_tokens += min(num_accepted, num_appended)
            self.kv.release_uncomputed(request)

    def _append(self, request: Request, token_ids: list[int]) -> int:
        """Append tokens up to and including the first that stops the request; returns
        how many were appended. A failure in checking (detokenizing a stop string, ...)
        is this request's alone: it finishes with the error."""
        for count, token_id in enumerate(token_ids, start=1):
            request.append_output_token(token_id)
            try:
                stop = self.stops.check(request, token_id)
            except Exception as error:  # noqa: BLE001 - attributed to this request
                logger.exception("request %s failed while its output was processed", request.request_id)
                self.finish_request(request, RequestStatus.FINISHED_ERROR,
                                    error=RequestError.output_failed(error))
                return count
            if stop is not None:
                self.finish_request(request, stop.status, stop.reason)
                return count
        return len(token_ids)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.running + self.waiting + self.receiving)
        self.state.check_integrity(self.running + self.waiting + self.receiving)
        self.kv_transfer.check_integrity()


class StaticBatchScheduler(Scheduler):
    """The baseline the seed argues against: admit a batch only when the previous one
    has fully finished, and reserve the model's maximum length for every request up
    front (as engines without paging must)."""

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]
                       ) -> tuple[Request | None, WaitReason | None]:
        if self.running:
            return None, WaitReason.STATIC_BATCH
        # Admit the whole batch at once; the running loop prefills it in later steps.
        for request in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs:
                return None, WaitReason.MAX_NUM_SEQS
            if not self.state.has_free_slot:
                return request, WaitReason.NO_FREE_STATE_SLOT
            if request.lora_key is not None and not self._holds_adapter(request, False):
                if request.is_finished:
                    continue
                return request, WaitReason.LORA_SLOT_BUSY
            # Max-length preallocation: what a system without paging must reserve.
            reserve = min(self.limits.max_model_len, self.kv.num_blocks * self.kv.block_size)
            if not self.kv.allocate_slots(request, reserve):
                self.adapters.free(request)
                return request, WaitReason.NO_FREE_BLOCKS
            self.state.allocate(request)
            self.waiting.remove(request)
            self.running.append(request)
            self._mark_admitted(request, None)
            num_new = min(request.num_tokens, budget)
            if num_new > 0:
                scheduled.append(ScheduledRequest.of(request, 0, num_new))
                budget -= num_new
        return None, None
