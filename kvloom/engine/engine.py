"""LLMEngine: add requests, call ``step()``, read per-request deltas.

``step()`` is the whole engine: schedule -> launch -> advance -> commit -> outputs
(with overlap scheduling the commit is the previous step's; engine/overlap.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvloom.batch import LogprobsEntry
from kvloom.cache.block_pool import BlockPool
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.prefix_cache import NoPrefixCache, PrefixCache
from kvloom.cache.radix_cache import RadixCache
from kvloom.cache.state_pool import NoStatePool, StatePool
from kvloom.config import EngineConfig, ModelConfig, with_hf_overrides
from kvloom.engine.admission import AdmissionLimits
from kvloom.engine.output import CompletionOutput, RequestOutput, StepProgress
from kvloom.engine.output_processor import OutputProcessor
from kvloom.engine.overlap import overlap_refusal
from kvloom.engine.policy import make_policy
from kvloom.engine.profiler import StepProfiler, write_trace
from kvloom.engine.scheduler import Scheduler, StaticBatchScheduler, StepUpdate
from kvloom.engine.speculation import SpeculationPolicy
from kvloom.engine.state_space import num_state_checkpoints, num_state_slots, state_space_config
from kvloom.engine.stop import StopChecker
from kvloom.generation_config import generation_defaults
from kvloom.kv_spec import KVExport, KVTransferSpec
from kvloom.kv_transfer.connector import layout_of, make_kv_transfer
from kvloom.lora.manager import LoRAManager
from kvloom.lora.request import LoRARequest
from kvloom.models.loader import load_checkpoint, replacement_tokenizer
from kvloom.models.sentence_transformers import with_pooler_config
from kvloom.native import release_openmp_team
from kvloom.request import Request, RequestError, RequestStatus
from kvloom.runner import cuda_graphs
from kvloom.runner.device import resolve_device, resolve_dtype
from kvloom.runner.model_runner import LaunchedStep, ModelRunner
from kvloom.runner.tensor_parallel import TensorParallelModel, load_first_rank, max_model_len_for
from kvloom.sampling_params import TOKEN_POOLING_TASKS, SamplingParams, tokenize_bad_words
from kvloom.speculative.proposer import Proposer, TargetModel, make_proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    step: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    num_cached_blocks: int
    num_evicted_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_batched_tokens: int = 0  # tokens the last step computed
    num_starvation_promotions: int = 0  # admissions forced by the starvation bound
    num_policy_fallbacks: int = 0  # steps the policy ordered FCFS instead (lpm, long queues)
    # Cumulative since start: tokens computed by prefill chunks, tokens generated.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Speculative decoding, cumulative: drafts verified, drafts accepted, verifications
    # (request-steps with drafts).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    # Tensor parallel, cumulative on rank 0 (0 for one process): collectives, the bytes
    # handed to them, seconds inside them (waiting for the slowest rank included).
    tp_collectives: int = 0
    tp_collective_bytes: int = 0
    tp_collective_seconds: float = 0.0
    # Prefill/decode disaggregation, cumulative. Decode instance: pulls of staged KV that
    # delivered, that failed (the request computed its prompt here), their bytes and
    # seconds. Prefill instance: prompts staged, their bytes, entries their puller
    # dropped, entries dropped unpulled at the deadline; staged entries held now.
    kv_imports: int = 0
    kv_import_failures: int = 0
    kv_import_bytes: int = 0
    kv_import_seconds: float = 0.0
    kv_staged: int = 0
    kv_staged_bytes: int = 0
    kv_staged_pulled: int = 0
    kv_staged_expired: int = 0
    num_receiving: int = 0  # requests whose prompt's KV is arriving now
    # State-space models: the state pool's slots, and those free now (0 and 0 otherwise).
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    num_cached_states: int = 0  # the prefix cache's state checkpoints, each a slot's worth
    # Prefix hits that ended inside a cached block, each copied into its request's first
    # private block (cumulative; their tokens count in prefix_cache_hit_tokens).
    num_block_copies: int = 0
    # LoRA (0 and empty without enable_lora): the slots, and the adapters of the running
    # and of the waiting requests, by name (sorted).
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Under a sliding window in every layer: blocks requests let go as their windows passed
    # them (cumulative; 0 otherwise).
    num_window_freed_blocks: int = 0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / max(1, self.num_verifications)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(1, self.prefix_cache_queried_tokens)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.monotonic()
        logger.info("loading %s", config.model if config.revision is None else f"{config.model}@{config.revision}")
        checkpoint = load_checkpoint(config.model, revision=config.revision)
        if config.tokenizer is not None:  # --tokenizer: another directory's, e.g. the base model's for a .gguf
            checkpoint.tokenizer = replacement_tokenizer(Path(config.tokenizer), checkpoint)
        self.model_name = checkpoint.name
        self.tokenizer = checkpoint.tokenizer
        if config.chat_template is not None:
            self.tokenizer.override_chat_template(config.chat_template)
        # Sampling defaults for the fields a request leaves unset (--generation-config).
        self.generation_defaults = generation_defaults(config.generation_config, checkpoint.path,
                                                       config.override_generation_config)
        checkpoint.hf_config = with_hf_overrides(checkpoint.hf_config, config.hf_overrides)  # --hf-overrides
        checkpoint.hf_config = with_pooler_config(checkpoint.hf_config, checkpoint.path, config.pooler_config)
        self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
        mc = self.model_config
        self.max_model_len = max_model_len_for(config, mc)
        # LongRoPE past its original context: a longer prompt's tokens all turn by the long factors.
        self.long_rope_from = mc.long_rope_from(self.max_model_len)
        if mc.keeps_state:  # Mamba2 or short-conv layers: a state pool, checkpoints to cache (engine/state_space.py)
            config = self.config = state_space_config(config, mc, self.max_model_len)
        # The model and its KV pool: here, or as rank 0 of a tensor-parallel group whose
        # other ranks hold the other shards (runner/tensor_parallel.py).
        self.first_rank = load_first_rank(config, mc, checkpoint, self.device, self.dtype, self.max_model_len)
        shard = self.first_rank.shard
        self.device = self.first_rank.device
        self.model, self.num_blocks, backend = shard.model, shard.num_blocks, shard.backend
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_ids + self.tokenizer.eos_token_ids))

        block_size = config.cache.block_size
        # Decode steps from CUDA graphs where they can be captured; their padding rows
        # write to a scratch block the pool never hands out: the last one.
        eager_reason = cuda_graphs.graph_refusal(mc.architecture, self.device.type == "cuda", backend,
                                                 self.first_rank.group.size, config.enforce_eager)
        scratch_block = None
        if eager_reason is None and config.lora.enable_lora:
            eager_reason = "LoRA adapters run the model as modules"
        if eager_reason is None:
            self.num_blocks -= 1
            scratch_block = self.num_blocks
        pool = BlockPool(self.num_blocks)
        self.state_pool: StatePool = NoStatePool()
        self.state_bytes_per_slot = 0  # a state-space model's fixed state per request, every layer
        checkpoint_slots: range | None = None  # the radix cache's state checkpoints, after the requests'
        if mc.keeps_state:
            from kvloom.models.mamba2 import allocate_state
            slots, checkpoints = num_state_slots(config), num_state_checkpoints(config)
            self.state_pool = StatePool(slots)
            checkpoint_slots = range(slots, slots + checkpoints)
            self.state_bytes_per_slot = allocate_state(self.model, slots + checkpoints) // (slots + checkpoints)
            logger.info("state pool: %d slots and %d prefix-cache checkpoints of %.1f MiB (every state "
                        "layer's state)", slots, checkpoints, self.state_bytes_per_slot / (1 << 20))
        prefix_cache: PrefixCache = (RadixCache(pool, block_size, checkpoint_slots)
                                     if config.cache.enable_prefix_caching else NoPrefixCache())
        # Under sliding windows in every layer a request lets go of the blocks its window has passed.
        self.kv_manager = KVCacheManager(pool, block_size, prefix_cache, mc.kv_window(self.max_model_len))
        self.output_processor = OutputProcessor(self.tokenizer, mc.pooler)
        # Speculative decoding's proposer (kvloom/speculative/), None when it is off.
        self.proposer: Proposer | None = None
        speculation = None
        if config.speculative_config is not None:
            self.proposer = make_proposer(TargetModel(config, self.model, mc, self.device, self.dtype,
                                                      self.max_model_len, self.num_blocks))
            speculation = SpeculationPolicy(config.speculative_config, self.proposer.draft_cost)
            logger.info("speculative decoding: %s", config.speculative_config)
        scheduler_class = (StaticBatchScheduler if config.scheduler.scheduling == "static"
                           else Scheduler)
        # The most tokens one step computes for a request: a chunk, or unchunked a whole
        # remainder (a preempted request's recomputation takes its whole sequence at once).
        chunk_tokens = (config.scheduler.max_num_batched_tokens if config.scheduler.enable_chunked_prefill
                        else self.max_model_len)
        self.limits = AdmissionLimits(self.max_model_len, mc.vocab_size, self.num_blocks, block_size,
                                      mc.vocab_size if config.max_logprobs == -1 else config.max_logprobs,
                                      self.kv_manager.window, chunk_tokens)
        # What this instance does with prompts' KV (--role; kvloom/kv_transfer/).
        self.kv_layout = layout_of(self.model_name, mc, shard.kv_caches, backend)
        self.kv_transfer = make_kv_transfer(config, self.kv_layout, shard.kv_caches)
        lora = None
        if config.lora.enable_lora:
            # Under tensor parallel: this rank's shard, and the other ranks told of each load.
            parallel = self.model if isinstance(self.model, TensorParallelModel) else None
            lora = LoRAManager(self.model if parallel is None else parallel.model, mc, config.lora.max_loras,
                               config.lora.max_lora_rank, config.matmul,
                               None if parallel is None else parallel.load_lora, config.lora.num_cpu_loras)
            logger.info("LoRA: %d adapter slots of rank <= %d", config.lora.max_loras, config.lora.max_lora_rank)
            if self.proposer is not None:  # built first: a layer_skip walk is built over unwrapped layers
                self.proposer.use_adapters(lora)
        self.scheduler = scheduler_class(config.scheduler, self.kv_manager,
                                         make_policy(config.scheduler), self.limits,
                                         StopChecker(self.output_processor), speculation, self.kv_transfer,
                                         self.state_pool, lora)
        self.runner = ModelRunner(self.model, shard.kv_caches, block_size, backend, self.device,
                                  mc.vocab_size, config.seed, lora, mc.pooler)
        if scratch_block is not None:
            captured = time.monotonic()
            self.runner.graphs = cuda_graphs.DecodeGraphs(
                self.model, shard.kv_caches, backend, block_size,
                min(config.scheduler.max_num_seqs, cuda_graphs.BUCKETS[-1]), -(-self.max_model_len // block_size),
                scratch_block, self.device, cuda_graphs.CUDACapture())
            logger.info("decode steps of up to %d requests replay CUDA graphs (%d buckets, captured in %.1f s)",
                        self.runner.graphs.max_batch, len(self.runner.graphs.sizes), time.monotonic() - captured)
        else:
            logger.debug("decode steps run eagerly: %s", eager_reason)
        logger.info("loaded %s in %.1f s: %s on %s, context %d, KV pool %d blocks of %d tokens%s, "
                    "%s attention%s", self.model_name, time.monotonic() - started, self.dtype, self.device,
                    self.max_model_len, self.num_blocks, block_size,
                    f" (let go behind every layer's {self.kv_manager.window}-key window)" if self.kv_manager.window
                    else "", backend.name,
                    f", tensor parallel {self.first_rank.group.size}" if self.first_rank.group.size > 1 else "")
        overlap_reason = overlap_refusal(config, self.device.type == "cuda", self.first_rank.group.size)
        self.overlap = overlap_reason is None
        logger.debug("overlap scheduling %s", "on" if self.overlap else f"off: {overlap_reason}")
        self._in_flight: LaunchedStep | None = None  # launched, committed by the next step()
        self.profiler = StepProfiler(self.device)  # start_profile / stop_profile
        self._request_counter = itertools.count()
        self._last_num_batched_tokens = 0
        # What the last step() committed (progress() reads it; nothing else keeps it).
        self._step_updates: list[StepUpdate] = []
        # The thread whose OpenMP team runs the forward on a CPU: the one that built the
        # engine (loading it ran parallel regions) until step() is called from another;
        # None after hand_over(): the next thread to step takes over silently.
        self._compute_thread: int | None = threading.get_ident()

    # ---- requests --------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, kv_transfer: KVTransferSpec | None = None,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Tokenize (if text) and queue a request. Raises ValueError for a request that
        can never be served: RequestRejected from the admission checks (empty, longer
        than the context, larger than the KV pool, token ids outside the vocabulary),
        an invalid constraint, or a ``kv_transfer`` this instance's role cannot do.
        ``cache_salt`` (vLLM's): prefix-cache hits only among requests of that salt.
        ``lora_request``: the LoRA adapter to run it with (an engine with enable_lora)."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, int):  # the policy compares them
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or "\0" in cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string without NUL, got {cache_salt!r}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a kvloom.LoRARequest, got {type(lora_request).__name__}")
        if params.n != 1:
            raise ValueError("n > 1 is handled by LLM.generate / the server, not by one engine request")
        refusal = self.kv_transfer.refuse(kv_transfer)
        if refusal is not None:
            raise ValueError(refusal)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        self._check_pooling(params)
        if params.max_tokens is None:  # as the server: up to the context or the pool's size
            params = replace(params, max_tokens=self.limits.default_max_tokens(len(token_ids)))
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=tokenize_bad_words(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        # Compiled before the request exists anywhere: a bad constraint leaves nothing behind.
        grammar = self.runner.compile_constraint(params.structured, self.tokenizer, self.eos_token_ids)
        rid = request_id if request_id is not None else self.new_request_id()
        # The adapter is checked now; its slot is taken when the scheduler admits the request.
        lora_key = self.runner.bind_lora(lora_request) if lora_request is not None else None
        request = Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt=text,
            kv_transfer=self.kv_transfer.accept(kv_transfer, token_ids, rid,
                                                None if lora_request is None else lora_request.lora_name),
            cache_salt=cache_salt,
            lora_key=lora_key,
            pools_every_token=params.pooling in TOKEN_POOLING_TASKS
            or (params.pooling == "embed" and self.model_config.pooler.seq_pooling != "LAST"),
            long_rope=self.long_rope_from is not None and len(token_ids) > self.long_rope_from,
        )
        self.scheduler.add_request(request)
        self.runner.add_request(request, grammar)
        self.output_processor.add(request)
        return request

    def _check_pooling(self, params: SamplingParams) -> None:
        """A classifier has no vocabulary head: it serves pooling requests alone, one
        position each past the prompt (the token sampled there, over its classes, is
        dropped), with nothing that reads a vocabulary; the classify tasks need such a
        model, and a token classifier classifies each token (token_classify), not the
        whole input. A token task reads the prompt alone: one position past it."""
        classifier = self.model_config.classifier
        if params.pooling in TOKEN_POOLING_TASKS and params.max_tokens not in (None, 1):
            raise ValueError(f"max_tokens must be 1 for pooling {params.pooling!r} (it reads the prompt), got "
                             f"{params.max_tokens}")
        if classifier is None:
            if params.pooling in ("classify", "token_classify"):
                raise ValueError(f"pooling {params.pooling!r} needs a classification model (a "
                                 "*ForSequenceClassification or *ForTokenClassification checkpoint); this model is "
                                 "a causal LM")
            return
        if params.pooling is None:
            raise ValueError(f"this model is a {classifier.kind} ({classifier.num_labels} classes, no vocabulary "
                             "head): it classifies and embeds, it does not generate text")
        if params.pooling == "classify" and classifier.per_token:
            raise ValueError("this model is a token classifier: it classifies each token (pooling 'token_classify'), "
                             "not the whole input")
        if params.max_tokens not in (None, 1):
            raise ValueError(f"max_tokens must be 1 for a {classifier.kind}'s request (it reads the prompt), got "
                             f"{params.max_tokens}")
        for name in ("logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
                     "structured", "thinking_budget"):
            if getattr(params, name) not in (None, []):
                raise ValueError(f"{name} is not supported by a {classifier.kind}: it has no vocabulary head")

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drop every prefix-cache block no request holds (e.g. between benchmark
        runs); False if requests hold some, which stay."""
        return self.kv_manager.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: record the ops of the steps from now on (engine/profiler.py);
        ValueError if a profile runs already."""
        self.profiler.start()

    def stop_profile(self, directory: str | Path) -> Path:
        """End the profile; its Chrome trace is written into ``directory``: the file's
        path. ValueError if none runs."""
        return write_trace(self.profiler.stop(), directory)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: check an adapter against the model and bind its name (ValueError naming
        what is wrong); requests naming it load it into a slot."""
        if self.runner.lora is None:
            raise ValueError("adding a LoRA adapter needs an engine started with enable_lora (--enable-lora)")
        self.runner.lora.add(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unbind an adapter's name (requests in flight on it finish); False if unknown."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_name)

    def new_request_id(self) -> str:
        """A fresh id for a request added without one: the counter's next value that no
        request in the engine holds (a caller may have chosen "1" itself)."""
        while (request_id := str(next(self._request_counter))) in self.scheduler.requests:
            pass
        return request_id

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self.kv_transfer.take_staged(request_id)  # nobody will ask for it (it expires unpulled)
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or a launched step not committed yet."""
        return self.scheduler.has_unfinished or self._in_flight is not None

    # ---- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that produced a token
        or ended. With overlap scheduling (engine/overlap.py) this launches a step and
        returns the outputs of the one launched before it."""
        if threading.get_ident() != self._compute_thread:
            self._moved_thread()
        self._step_updates = []
        self.profiler.step()  # a span per step while a profile runs
        if self.proposer is not None:
            # Drafts for the tokens the last step appended: proposed here rather than at
            # the end of that step, so that its outputs (a first token) were not held
            # back by a draft model catching up on a prompt.
            self._propose()
        scheduled = self.scheduler.schedule()
        self._last_num_batched_tokens = scheduled.num_batched_tokens
        outputs = self._ended_while_scheduling()
        # An exception from the forward itself is an engine fault and propagates.
        launched = None if scheduled.is_empty else self.runner.launch(scheduled)
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            outputs += self._commit(previous)
        if launched is None:
            if not outputs and self.scheduler.receiving:  # nothing to run until a pull arrives
                self.kv_transfer.wait(0.005)
            return outputs
        # The previous step's tokens are in: this one's progress counts from them.
        self.scheduler.advance(scheduled)
        if self.overlap and launched.overlappable:
            self._in_flight = launched  # committed by the next call, while its successor runs
            return outputs
        return outputs + self._commit(launched)

    def hand_over(self) -> None:
        """Call on the thread that built (or last stepped) the engine when another
        thread will step it from now on: this thread's OpenMP team is released
        (native.release_openmp_team), so the next thread's team is the process's only
        one, and that thread takes over without the warning of _moved_thread."""
        if self.device.type == "cpu":
            release_openmp_team()
        self._compute_thread = None

    def _moved_thread(self) -> None:
        """step() on another thread than the last one that computed for this engine. On
        a CPU each thread that runs parallel regions keeps its own OpenMP team; with two,
        libgomp manages more threads than there are cores and cuts every barrier's spin
        short, so each of a step's few hundred parallel regions sleeps and wakes on a
        futex (a decode step 12-28% slower on two cores: docs/results/issue17/genoa6/
        forward_thread.txt). Said once per move: the step itself is correct either way."""
        handed_over = self._compute_thread is None
        self._compute_thread = threading.get_ident()
        if self.device.type == "cpu" and not handed_over:
            logger.warning("LLMEngine.step() now runs on thread %s, not on the thread that built the engine or "
                           "last stepped it: that thread's OpenMP team stays, and with two teams on a CPU "
                           "every step runs slower (libgomp shortens its barriers' spinning when it manages "
                           "more threads than there are cores). Build and step the engine on one thread, as "
                           "`kvloom serve` and LLM do, or call LLMEngine.hand_over() on the old thread first.",
                           threading.current_thread().name)

    def _commit(self, launched: LaunchedStep) -> list[RequestOutput]:
        """A launched step's samples into its requests (the scheduler alone writes
        request state: tokens, stops, failures), and their outputs."""
        result = self.runner.finish(launched)
        scheduled = launched.scheduled
        if result.prompt_logprobs:  # only steps that computed some for a request that asked
            for item in scheduled.scheduled:
                chunk = result.prompt_logprobs.get(item.request.request_id)
                if chunk is not None:
                    self.output_processor.add_prompt_logprobs(item.request, chunk)
        if result.pooled:  # pooling requests' vectors
            for item in scheduled.scheduled:
                if (vector := result.pooled.get(item.request.request_id)) is not None:
                    self.output_processor.add_pooled(item.request, vector)
        if result.token_pooled:  # token-pooling requests' chunks
            for item in scheduled.scheduled:
                if (vectors := result.token_pooled.get(item.request.request_id)) is not None:
                    self.output_processor.add_token_pooled(item.request, vectors)
        updates = self.scheduler.commit(scheduled, result)
        self._step_updates.extend(updates)
        outputs = (self._output(update.request, result.new_logprobs(update.index)[:update.num_new_tokens])
                   for update in updates)
        return [output for output in outputs if output is not None]  # None: FINAL_ONLY, not finished

    def _ended_while_scheduling(self) -> list[RequestOutput]:
        """The outputs of requests the scheduler ended with an error while admitting them
        (an adapter unloaded while the request waited)."""
        ended = self.scheduler.take_ended()
        if not ended:  # nearly every step
            return []
        self._step_updates.extend(StepUpdate(request, -1, 0) for request in ended)
        outputs = (self._output(request, []) for request in ended)
        return [output for output in outputs if output is not None]

    def progress(self) -> list[StepProgress]:
        """What the last ``step()`` did for each request that gained tokens or finished,
        whatever its ``output_kind``: the server's metrics count from these, so that a
        ``FINAL_ONLY`` request needs no per-step output. Built on demand (``LLM.generate``
        never asks), from the requests as the step left them."""
        return [StepProgress(update.request.request_id, update.num_new_tokens, update.request.num_output_tokens,
                             update.request.num_prompt_tokens, update.request.num_cached_tokens,
                             update.request.timeline,
                             update.request.status.value if update.request.is_finished else None)
                for update in self._step_updates]

    def _propose(self) -> None:
        """Drafts for the next step's decodes, where the scheduler has room for them."""
        assert self.proposer is not None
        candidates = self.scheduler.draft_candidates()
        if candidates:
            requests = [request for request, _ in candidates]
            drafts = self.proposer.propose(requests, [count for _, count in candidates])
            # A constrained request's drafts are cut where its grammar stops allowing them.
            self.scheduler.set_draft_tokens({request: self.runner.valid_drafts(request, tokens)
                                             for request, tokens in zip(requests, drafts, strict=True)})

    def _output(self, request: Request, new_logprobs: list[LogprobsEntry | None]) -> RequestOutput | None:
        """The request's output for this step (None where its output_kind asks for none
        yet), inside the boundary that makes a failure here (detokenizing, logprobs) this
        request's alone: it finishes with an error and the rest of the step goes on. A
        finished request's state is dropped."""
        try:
            output = self.output_processor.make_output(request, new_logprobs)
        except Exception as error:  # noqa: BLE001 - attributed to this request
            logger.exception("request %s failed while its output was processed", request.request_id)
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR,
                                          error=RequestError.output_failed(error))
            output = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                   [CompletionOutput(0, "", list(request.output_token_ids), "error")],
                                   finished=True, metrics=request.timeline, error=request.error)
        if request.is_finished:
            assert output is not None, "a finished request always has its output"
            if isinstance(request.kv_transfer, KVExport):
                staged = self.kv_transfer.take_staged(request.request_id)
                output.kv_transfer_params = staged.as_dict() if staged is not None else None
            self._release(request)
        return output

    def _release(self, request: Request) -> None:
        self.runner.release(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        self.output_processor.discard(request)

    def stats(self) -> EngineStats:
        s, kv, comm = self.scheduler, self.kv_manager, self.first_rank.group.stats
        imports, staged = self.kv_transfer.imports, self.kv_transfer.staging_stats
        return EngineStats(s.step_count, len(s.running), len(s.waiting), kv.usage,
                           s.num_preemptions, kv.pool.num_free_blocks, self.num_blocks,
                           kv.prefix_cache.num_cached_blocks, kv.num_evicted_blocks,
                           s.num_queried_prompt_tokens, s.num_cached_prompt_tokens,
                           self._last_num_batched_tokens, s.num_starvation_promotions,
                           s.policy.num_fcfs_fallbacks, s.num_prefill_tokens,
                           s.num_generated_tokens, s.num_draft_tokens, s.num_accepted_tokens,
                           s.num_verifications, comm.calls, comm.bytes, comm.seconds,
                           imports.imports, imports.failures, imports.bytes, imports.seconds,
                           staged.staged, staged.staged_bytes, staged.pulled, staged.expired,
                           len(s.receiving), self.state_pool.num_slots, self.state_pool.num_free_slots,
                           kv.prefix_cache.num_cached_states, s.num_block_copies, *self._lora_stats(),
                           num_window_freed_blocks=kv.num_window_freed_blocks)

    def _lora_stats(self) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
        lora = self.runner.lora
        if lora is None:
            return 0, (), ()
        return lora.max_loras, lora.adapters_of(self.scheduler.running), lora.adapters_of(self.scheduler.waiting)

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's other ranks and leave its process group (a
        single-process engine holds nothing to release), and its KV connector (staged KV
        files, the transfer thread). The engine serves no more."""
        self.kv_transfer.close()
        self.first_rank.shutdown()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.runner.lora is not None:
            self.runner.lora.check_integrity({r.request_id for r in self.scheduler.running + self.scheduler.receiving})
        if self.proposer is not None:
            self.proposer.check_integrity()
