"""Prometheus metrics for the server, named as vLLM names them (``vllm:`` -> ``kvloom:``).

Each app owns a dedicated ``CollectorRegistry`` (two servers in one process, as in the
tests, do not collide). Everything is recorded on the engine thread, right after a
step; prometheus_client's metric objects are thread-safe, and ``/metrics`` reads them
from the event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvloom.engine.output import StepProgress

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Request phases that span many steps (decode, inference): a CPU decode of a few hundred
# ms a token reaches minutes for a long output, past the 80 s of the step-scale list.
_REQUEST_LATENCY_BUCKETS = (*_LATENCY_BUCKETS, 160.0, 320.0, 640.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Prompt and output lengths per request: 1-2-5 steps (as vLLM's build_1_2_5_buckets) up
# to 100k tokens, past any context length kvloom serves today.
_LENGTH_BUCKETS = tuple(float(m * 10 ** e) for e in range(5) for m in (1, 2, 5)) + (100_000.0,)


class EngineMetrics:
    """Counters, gauges and histograms fed by the engine thread once per step."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        gauge = functools.partial(Gauge, registry=self.registry)
        counter = functools.partial(Counter, registry=self.registry)
        latency = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.num_requests_running = gauge("kvloom:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "kvloom:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_cache_usage = gauge(
            "kvloom:kv_cache_usage_perc",
            "Fraction of KV blocks held by requests (1 = full); idle prefix-cache blocks count as free.")
        self.num_preemptions = counter(
            "kvloom:num_preemptions", "Requests preempted (KV freed, recomputed later).")
        self.prompt_tokens = counter("kvloom:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("kvloom:generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "kvloom:request_success", "Requests finished, by finish reason.", ["finished_reason"])
        self.prefix_cache_queries = counter(
            "kvloom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "kvloom:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.time_to_first_token = latency(
            "kvloom:time_to_first_token_seconds", "Arrival to first generated token.")
        self.inter_token_latency = latency(
            "kvloom:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e_request_latency = latency("kvloom:e2e_request_latency_seconds", "Arrival to finish.")
        self.request_queue_time = latency("kvloom:request_queue_time_seconds", "Arrival to first scheduled.")
        # Per request the engine finishes (stop, length, error; a client's abort has no
        # output), as vLLM's. The first token splits first-scheduled-to-finish into
        # prefill and decode: prefill + decode == inference <= e2e for every request.
        request_latency = functools.partial(Histogram, buckets=_REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.request_prefill_time = latency(
            "kvloom:request_prefill_time_seconds",
            "First scheduled to first generated token (waits after a preemption included).")
        self.request_decode_time = request_latency(
            "kvloom:request_decode_time_seconds", "First generated token to finish.")
        self.request_inference_time = request_latency(
            "kvloom:request_inference_time_seconds", "First scheduled to finish.")
        lengths = functools.partial(Histogram, buckets=_LENGTH_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = lengths(
            "kvloom:request_prompt_tokens", "Prompt tokens of each finished request.")
        self.request_generation_tokens = lengths(
            "kvloom:request_generation_tokens", "Tokens generated for each finished request.")
        self.iteration_tokens = Histogram(
            "kvloom:iteration_tokens_total", "Tokens processed per engine step (prefill + decode).",
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        # Speculative decoding, named as vLLM's: verifications (a request-step with
        # drafts), draft tokens verified, draft tokens accepted.
        self.spec_decode_num_drafts = counter(
            "kvloom:spec_decode_num_drafts", "Speculative verifications (a request's step with drafts).")
        self.spec_decode_num_draft_tokens = counter(
            "kvloom:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "kvloom:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.")
        self.spec_decode_acceptance_rate = gauge(
            "kvloom:spec_decode_acceptance_rate", "Accepted / verified draft tokens, since start.")
        self.spec_decode_mean_accepted_length = gauge(
            "kvloom:spec_decode_mean_accepted_length",
            "Tokens per verification (accepted drafts + the target's own), since start.")
        # Tensor parallel (rank 0's view; zero for one process).
        self.tp_collectives = counter(
            "kvloom:tp_collectives", "Tensor-parallel collectives run by rank 0 (all-reduce, broadcast, gather).")
        self.tp_collective_bytes = counter(
            "kvloom:tp_collective_bytes", "Bytes rank 0 handed to tensor-parallel collectives.")
        self.tp_collective_seconds = counter(
            "kvloom:tp_collective_seconds",
            "Seconds rank 0 spent inside tensor-parallel collectives (waiting for the slowest rank included).")
        # Prefill/decode disaggregation (zero for --role both).
        self.kv_imports = counter(
            "kvloom:kv_transfer_imports", "Decode instance: pulls of staged KV that delivered.")
        self.kv_import_failures = counter(
            "kvloom:kv_transfer_import_failures",
            "Decode instance: staged KV refused or not pulled (those requests computed their prompts here).")
        self.kv_import_bytes = counter("kvloom:kv_transfer_import_bytes", "Decode instance: KV bytes pulled.")
        self.kv_import_seconds = counter(
            "kvloom:kv_transfer_import_seconds", "Decode instance: seconds spent pulling KV (transfer thread).")
        self.kv_staged = counter("kvloom:kv_transfer_staged", "Prefill instance: prompts whose KV was staged.")
        self.kv_staged_bytes = counter("kvloom:kv_transfer_staged_bytes", "Prefill instance: KV bytes staged.")
        self.kv_staged_expired = counter(
            "kvloom:kv_transfer_staged_expired", "Prefill instance: staged KV dropped unpulled at its deadline.")
        self.num_requests_receiving = gauge(
            "kvloom:num_requests_receiving", "Decode instance: requests whose prompt's KV is arriving.")
        self.state_slots_usage = gauge(
            "kvloom:state_slots_usage_perc",
            "State-space models: share of the state slots held by running requests (1 = all).")
        self.num_cached_blocks = gauge(
            "kvloom:num_cached_blocks", "KV blocks the prefix cache indexes, held by requests or idle.")
        self.num_evicted_blocks = counter(
            "kvloom:num_evicted_blocks", "Idle prefix-cache blocks evicted to make room for new KV.")
        self.num_window_freed_blocks = counter(
            "kvloom:num_window_freed_blocks",
            "KV blocks requests let go once every layer's sliding window had passed them.")
        self.prefix_cache_block_copies = counter(
            "kvloom:prefix_cache_block_copies",
            "Prefix hits that ended inside a cached block, whose tokens were copied (counted in the hits).")
        self.num_cached_states = gauge(
            "kvloom:num_cached_states",
            "State-space models: state checkpoints the prefix cache holds (a hit needs one).")
        # vLLM's vllm:lora_requests_info: one sample whose labels name the adapters of the
        # running and of the waiting requests (comma-separated), its value the time of the
        # last change (what LoRA-aware gateways read).
        self.lora_requests_info = gauge(
            "kvloom:lora_requests_info", "Running and waiting LoRA adapters (labels); value: when they last changed.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        self._lora_seen: tuple[str, str, str] | None = None
        self._kv_seen: tuple[float, ...] = (0, 0, 0, 0.0, 0, 0, 0)
        self._num_preemptions_seen = 0
        self._cache_seen = (0, 0, 0)  # evicted blocks, block copies, blocks let go behind a window
        self._spec_seen = (0, 0, 0)
        self._tp_seen: tuple[float, ...] = (0, 0, 0.0)
        # request id -> monotonic time of its previous token; engine thread only.
        self._last_token_time: dict[str, float] = {}

    # ---- engine thread ---------------------------------------------------------------
    def record_step(self, progress: Sequence[StepProgress], now: float,
                    num_batched_tokens: int | None) -> None:
        """After one ``LLMEngine.step()``: token and latency metrics from what it did for
        each request (``LLMEngine.progress()``: every request, whatever its output_kind).
        ``now`` is ``time.monotonic()``, the clock of ``RequestTimeline``."""
        if num_batched_tokens is not None:
            self.iteration_tokens.observe(num_batched_tokens)
        for entry in progress:
            if entry.num_new_tokens:
                self.generation_tokens.inc(entry.num_new_tokens)
                previous = self._last_token_time.get(entry.request_id)
                if previous is None:
                    self._on_first_token(entry)
                else:
                    self.inter_token_latency.observe(now - previous)
                self._last_token_time[entry.request_id] = now
            if entry.finish_reason is not None:
                self._on_finished(entry, entry.finish_reason)

    def record_state(self, stats: Any) -> None:
        """Gauges from ``LLMEngine.stats()``; called after every loop iteration."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_usage)
        if stats.num_preemptions > self._num_preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions - self._num_preemptions_seen)
            self._num_preemptions_seen = stats.num_preemptions
        self.num_cached_blocks.set(stats.num_cached_blocks)
        cache = (stats.num_evicted_blocks, stats.num_block_copies, stats.num_window_freed_blocks)
        if cache != self._cache_seen:
            _advance((self.num_evicted_blocks, self.prefix_cache_block_copies, self.num_window_freed_blocks),
                     cache, self._cache_seen)
            self._cache_seen = cache
        spec = (stats.num_verifications, stats.num_draft_tokens, stats.num_accepted_tokens)
        if spec != self._spec_seen:
            _advance((self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                      self.spec_decode_num_accepted_tokens), spec, self._spec_seen)
            self._spec_seen = spec
            self.spec_decode_acceptance_rate.set(stats.draft_acceptance_rate)
            self.spec_decode_mean_accepted_length.set(stats.mean_accepted_length)
        tp = (stats.tp_collectives, stats.tp_collective_bytes, stats.tp_collective_seconds)
        if tp != self._tp_seen:
            _advance((self.tp_collectives, self.tp_collective_bytes, self.tp_collective_seconds), tp, self._tp_seen)
            self._tp_seen = tp
        self.num_requests_receiving.set(stats.num_receiving)
        if stats.max_loras:
            lora = (str(stats.max_loras), ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters))
            if lora != self._lora_seen:
                if self._lora_seen is not None:
                    self.lora_requests_info.remove(*self._lora_seen)
                self.lora_requests_info.labels(*lora).set_to_current_time()
                self._lora_seen = lora
        if stats.num_state_slots:
            self.state_slots_usage.set(1 - stats.num_free_state_slots / stats.num_state_slots)
            self.num_cached_states.set(stats.num_cached_states)
        kv = (stats.kv_imports, stats.kv_import_failures, stats.kv_import_bytes, stats.kv_import_seconds,
              stats.kv_staged, stats.kv_staged_bytes, stats.kv_staged_expired)
        if kv != self._kv_seen:
            _advance((self.kv_imports, self.kv_import_failures, self.kv_import_bytes, self.kv_import_seconds,
                      self.kv_staged, self.kv_staged_bytes, self.kv_staged_expired), kv, self._kv_seen)
            self._kv_seen = kv

    def record_aborted(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_success.labels("abort").inc()

    def _on_first_token(self, entry: StepProgress) -> None:
        self.prompt_tokens.inc(entry.num_prompt_tokens)
        # In tokens, as vLLM counts them: the hit rate is hits / queries.
        self.prefix_cache_queries.inc(entry.num_prompt_tokens)
        self.prefix_cache_hits.inc(entry.num_cached_tokens)
        if entry.timeline.ttft is not None:
            self.time_to_first_token.observe(entry.timeline.ttft)
        if entry.timeline.queue_time is not None:
            self.request_queue_time.observe(entry.timeline.queue_time)

    def _on_finished(self, entry: StepProgress, reason: str) -> None:
        self._last_token_time.pop(entry.request_id, None)
        self.request_success.labels(reason).inc()
        self.request_prompt_tokens.observe(entry.num_prompt_tokens)
        self.request_generation_tokens.observe(entry.num_output_tokens)
        timeline = entry.timeline
        if timeline.finished_time is None:
            return
        self.e2e_request_latency.observe(timeline.finished_time - timeline.arrival_time)
        scheduled, first_token = timeline.first_scheduled_time, timeline.first_token_time
        if scheduled is not None:  # else it failed before it was ever scheduled
            self.request_inference_time.observe(timeline.finished_time - scheduled)
            if first_token is not None:  # else it failed during its prefill
                self.request_prefill_time.observe(first_token - scheduled)
                self.request_decode_time.observe(timeline.finished_time - first_token)

    # ---- event loop ------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


def _advance(counters: Sequence[Counter], totals: Sequence[float], seen: Sequence[float]) -> None:
    """Counters that mirror the engine's cumulative totals: each goes up by what its
    total gained since ``seen``."""
    for counter, total, before in zip(counters, totals, seen, strict=True):
        counter.inc(total - before)
