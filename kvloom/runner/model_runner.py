"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> logits -> sampled tokens.

The runner never mutates request state; it reads the scheduled requests and returns
one token (or None, for a prefill chunk that does not reach the end) per entry, plus
the tokens a grammar forces after it (jump-forward). Per-request state lives here,
keyed by request id and dropped by ``release``: random generators (so a seeded
request draws the same numbers whatever else is in the batch) and grammar matchers.

A step is ``launch``ed (forward and sampling queued on the device, nothing waited
for) and later ``finish``ed (its samples on the host); between the two the engine may
schedule and launch the next step (overlap scheduling, engine/engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import (
    ForwardBatch,
    LogprobsEntry,
    PromptLogprobs,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenPooled,
)
from kvloom.lora.manager import LoRAManager
from kvloom.lora.request import LoRARequest
from kvloom.model_families import PoolerConfig
from kvloom.models.mamba2 import copy_state
from kvloom.models.registry import CausalLM
from kvloom.request import Request, RequestError
from kvloom.runner.cuda_graphs import DecodeGraphs
from kvloom.runner.kv_pool import copy_blocks
from kvloom.runner.prompt_logprobs import prompt_logprobs
from kvloom.runner.sampler import DeviceSample, Sampler
from kvloom.runner.sampling_metadata import SamplingMetadata, SamplingRequestState, generator_for_seed
from kvloom.runner.token_pooling import token_pooling
from kvloom.structured.compiler import CompiledGrammar
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.manager import StructuredOutputManager
from kvloom.structured.mask import GrammarMask
from kvloom.tokenizer import Tokenizer


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device, from ``ModelRunner.launch`` to ``finish``."""

    scheduled: SchedulerOutput
    prompt_logprobs: dict[str, PromptLogprobs]
    sampling: list[ScheduledRequest] = field(default_factory=list)  # the entries that sample
    sample: DeviceSample | None = None  # None: no entry samples
    grammar: GrammarMask | None = None
    failed: dict[str, RequestError] = field(default_factory=dict)  # requests whose grammar failed
    # Seeded random requests with drafts: their generators' state before the draws.
    rewinds: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    # Pooling requests' vectors (SamplingParams.pooling): per task, the requests' ids and
    # their rows, [n, width] float32 on the device (read back in one copy each).
    pooled: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)
    # Token-pooling requests' chunks (runner/token_pooling.py): (id, first position, rows).
    token_pooled: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)

    @property
    def overlappable(self) -> bool:
        """Whether the next step may be scheduled and launched before this one finishes:
        no entry's next token depends on this step's values on the host (no drafts to
        verify, no grammar to advance, no penalties or min_tokens)."""
        return all(not item.draft_token_ids and not item.request.sampling_params.reads_previous_tokens
                   for item in self.sampling)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: torch.Tensor, block_size: int,
                 backend: AttentionBackend[Any], device: torch.device, vocab_size: int,
                 seed: int, lora: LoRAManager | None = None, pooler: PoolerConfig | None = None) -> None:
        self.model = model
        self.pooler = pooler or PoolerConfig()  # how "embed" pools (the last token, or every one)
        self.lora = lora  # the adapters' slots (kvloom/lora); None: LoRA is off
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler(generator_for_seed(seed, device))
        self._generators: dict[str, torch.Generator] = {}
        self.structured = StructuredOutputManager(vocab_size, device)
        # Decode steps replayed from captured graphs (runner/cuda_graphs.py); None: eager.
        self.graphs: DecodeGraphs | None = None
        # The last launch's samples on the device, and each sampling request's row in
        # them: the inputs of the next step's pending tokens (overlap scheduling).
        self._pending_tokens: torch.Tensor | None = None
        self._pending_rows: dict[str, int] = {}
        self._pooling_requests: set[str] = set()  # in flight with SamplingParams.pooling

    # ---- per-request state -----------------------------------------------------------
    def compile_constraint(self, constraint: StructuredOutput | None, tokenizer: Tokenizer,
                           eos_token_ids: Sequence[int]) -> CompiledGrammar | None:
        """Compile (or fetch from the cache) a request's constraint before it is queued.
        Raises ValueError naming the problem for an invalid or unsupported one."""
        return self.structured.compile(constraint, tokenizer, eos_token_ids)

    def add_request(self, request: Request, grammar: CompiledGrammar | None) -> None:
        """Set up a queued request's per-request state (its grammar matcher, if any)."""
        self.structured.add_request(request, grammar)
        if request.sampling_params.pooling is not None:
            self._pooling_requests.add(request.request_id)

    def bind_lora(self, lora: LoRARequest) -> str:
        """Check ``lora``'s adapter for a request about to be queued and return its
        identity (prefix cache, slots); ValueError naming what is wrong if it cannot be
        served. Its slot is the scheduler's to take, at admission."""
        if self.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora (--enable-lora)")
        return self.lora.bind(lora)

    def valid_drafts(self, request: Request, draft_token_ids: list[int]) -> list[int]:
        """The prefix of a proposer's drafts that the request's grammar (if any) allows."""
        return self.structured.valid_drafts(request, draft_token_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and grammar matcher."""
        self._generators.pop(request_id, None)
        self._pooling_requests.discard(request_id)
        self.structured.release(request_id)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = generator_for_seed(seed, self.device)
        return generator

    # ---- one step --------------------------------------------------------------------
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run one step to its end: ``finish(launch(output))``."""
        return self.finish(self.launch(output))

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and return without
        waiting for them (on the CPU they run here). Input tokens that are the previous
        launch's pending samples are read from its device tensor, so that step need not
        have finished."""
        batch = ForwardBatch.build(output, self.block_size, self.device, self._pending_rows,
                                   self.lora.slots() if self.lora is not None else None)
        if batch.placeholder_positions is not None:
            assert self._pending_tokens is not None and batch.placeholder_rows is not None
            batch.input_ids[batch.placeholder_positions] = self._pending_tokens[batch.placeholder_rows]
        if batch.block_copies is not None:  # prefix hits that end inside a cached block
            copy_blocks(self.kv_caches, batch.block_copies)
        if output.state_restores:  # a state-space model's prefix hits start from their checkpoints
            copy_state(self.model, output.state_restores)
        if self.graphs is not None and self.graphs.serves(batch, any(i.draft_token_ids for i in output.scheduled)):
            hidden = self.graphs.run(batch)
        elif batch.lora_slots is not None:
            assert self.lora is not None
            self.lora.step.begin(batch.lora_slots, batch.query_lens_list, self.device, batch.output_rows)
            try:
                hidden = self.model(batch, self.kv_caches, self.backend, self.backend.prepare(batch))
            finally:
                self.lora.step.end()
        else:
            hidden = self.model(batch, self.kv_caches, self.backend, self.backend.prepare(batch))
        if output.state_saves:  # ... and chunks that end at a checkpoint save theirs
            copy_state(self.model, output.state_saves)
        launched = LaunchedStep(output, prompt_logprobs(self.model, hidden, output))
        if self._pooling_requests:
            launched.token_pooled = token_pooling(self.model, hidden, output, self.pooler.normalize)
        launched.sampling = [item for item in output.scheduled if item.samples]
        self._pending_tokens, self._pending_rows = None, {}
        if not launched.sampling:
            return launched
        # In the model's dtype: a greedy batch's argmax reads bf16 as it is (the sampler
        # widens to float32 where it computes, the same values either way).
        # hidden holds the sampled rows alone where the batch named them (output_rows).
        final = hidden if batch.output_rows is not None else hidden[batch.logits_indices]  # [sampled rows, hidden]
        logits = self.model.compute_logits(final)
        if self._pooling_requests:
            self._pool(launched, final, logits)
        # One sampling row per position sampled at: the last known token, then each
        # draft, whose row sees the drafts before it as output (penalties, min_tokens).
        rows = [
            SamplingRequestState(
                params=item.request.sampling_params,
                prompt_token_ids=item.request.prompt_token_ids,
                output_token_ids=(item.request.output_token_ids if not draft
                                  else item.request.output_token_ids + list(item.draft_token_ids[:draft])),
                generator=self._generator_for(item.request.request_id, item.request.sampling_params.seed),
                eos_token_ids=item.request.eos_token_ids,
            )
            for item in launched.sampling for draft in range(item.num_sampled_rows)
        ]
        # Host-side mask work after the forward is queued: on an accelerator it overlaps
        # the model. None (and no work at all) when no sampling row is constrained.
        launched.grammar = self.structured.grammar_mask(
            [(item.request, item.draft_token_ids) for item in launched.sampling], launched.failed)
        if len(rows) > len(launched.sampling):
            launched.rewinds = self._seeded_rewinds(launched.sampling)
        launched.sample = self.sampler.sample(
            logits, SamplingMetadata.build(rows, logits.shape[-1], self.device, launched.grammar))
        if launched.overlappable:  # one row per sampling entry: the next step's placeholders
            self._pending_tokens = launched.sample.token_ids
            self._pending_rows = {item.request.request_id: row for row, item in enumerate(launched.sampling)}
        return launched

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's samples (that step only, not those launched after
        it) and turn them into its RunnerOutput: drafts verified, grammars advanced."""
        output, sampling = launched.scheduled, launched.sampling
        token_pooled = {request_id: TokenPooled(first, vectors.cpu())
                        for request_id, first, vectors in launched.token_pooled}
        if launched.sample is None:
            return RunnerOutput([None] * len(output.scheduled), [None] * len(output.scheduled),
                                prompt_logprobs=launched.prompt_logprobs, token_pooled=token_pooled)
        result = launched.sample.result()
        token_ids, logprobs = result.token_ids, result.logprobs
        accepted: list[list[int]] | None = None
        if any(item.draft_token_ids for item in sampling):
            token_ids, logprobs, accepted, accepted_logprobs = verify_drafts(sampling, token_ids, logprobs)
            for index, (generator, state) in launched.rewinds.items():
                self._advance_to(generator, state, len(accepted[index]) + 1)
        forced = None
        if launched.grammar is not None or self.structured.num_waiting:
            forced = self.structured.advance([item.request for item in sampling], token_ids, launched.failed,
                                             accepted)
        aligned = self._align(output, token_ids, logprobs, forced, launched.failed)
        if accepted is not None:
            aligned.accepted = self._aligned_rows(output, accepted, [])
            aligned.accepted_logprobs = self._aligned_rows(output, accepted_logprobs, [])
        aligned.prompt_logprobs = launched.prompt_logprobs
        aligned.pooled = {request_id: vector for ids, vectors in launched.pooled
                          for request_id, vector in zip(ids, vectors.tolist(), strict=True)}
        aligned.token_pooled = token_pooled
        return aligned

    def _pool(self, launched: LaunchedStep, final: torch.Tensor, logits: torch.Tensor) -> None:
        """Last-token pooling: a pooling request samples at its prompt's last token, whose
        final hidden state is row ``r`` of ``final`` (one row per sampling row) and whose
        head output is row ``r`` of ``logits``. "embed" keeps the hidden state in float32,
        L2-normalized unless the pooler says not (each task's rows in one call, as a
        request alone computes them: a row's values do not depend on the rows beside it);
        "classify" the head's row, a sequence classifier's class logits. A request that
        pools every token has its vectors from ``token_pooling``."""
        rows: dict[str, list[tuple[str, int]]] = {"embed": [], "classify": []}
        row = 0
        for item in launched.sampling:
            task = item.request.sampling_params.pooling
            if task in rows and not item.request.pools_every_token:
                rows[task].append((item.request.request_id, row))
            row += item.num_sampled_rows
        if rows["embed"]:
            vectors = final[[r for _, r in rows["embed"]]].float()
            if self.pooler.normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            launched.pooled.append(([i for i, _ in rows["embed"]], vectors))
        if rows["classify"]:
            launched.pooled.append(([i for i, _ in rows["classify"]], logits[[r for _, r in rows["classify"]]].float()))

    def _seeded_rewinds(self, sampling: list[ScheduledRequest]) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
        """The generator state, before this step's draws, of each seeded random request
        with drafts (by its index among the sampling requests)."""
        rewinds = {}
        for index, item in enumerate(sampling):
            params = item.request.sampling_params
            if item.draft_token_ids and params.seed is not None and not params.is_greedy:
                generator = self._generator_for(item.request.request_id, params.seed)
                assert generator is not None
                rewinds[index] = (generator, generator.get_state())
        return rewinds

    def _advance_to(self, generator: torch.Generator, state: torch.Tensor, num_tokens: int) -> None:
        """Leave a seeded request's generator as if it had drawn for ``num_tokens`` rows,
        the tokens it produced, not one per draft: each output token then takes the
        uniform of its position, so a seeded request gives the same tokens with and
        without speculation (the sampler draws one uniform per row, in row order)."""
        generator.set_state(state)
        for _ in range(num_tokens):
            torch.empty(1, dtype=torch.float32, device=self.device).uniform_(generator=generator)

    @staticmethod
    def _aligned_rows(output: SchedulerOutput, values: list[Any], missing: Any) -> list[Any]:
        """Per-sampling-request values -> per-scheduled-entry values (``missing`` where
        the entry samples nothing)."""
        rows = iter(values)
        return [next(rows) if item.samples else missing for item in output.scheduled]

    @classmethod
    def _align(cls, output: SchedulerOutput, token_ids: list[int], logprobs: list[LogprobsEntry | None],
               forced: list[list[int]] | None, failed: dict[str, RequestError]) -> RunnerOutput:
        """Per-sampling-request results -> per-scheduled-entry results (None where no sample)."""
        return RunnerOutput(
            sampled=cls._aligned_rows(output, token_ids, None),
            logprobs=cls._aligned_rows(output, logprobs, None),
            forced=None if forced is None else cls._aligned_rows(output, forced, []),
            failed=failed,
        )


def verify_drafts(sampling: list[ScheduledRequest], token_ids: list[int],
                  logprobs: list[LogprobsEntry | None]
                  ) -> tuple[list[int], list[LogprobsEntry | None], list[list[int]], list[list[LogprobsEntry | None]]]:
    """Speculative verification over the rows sampled at each request's last known
    token and drafts: ``token_ids[r]`` was drawn from the target's own distribution at
    that position (greedy or random, every sampling knob applied), given the drafts
    before it. A draft is accepted while it equals the target's sample at the position
    before it; the first sample that differs, or the sample after the last draft, is
    the request's next token.

    This is speculative rejection sampling for a proposer that guesses one token (q is
    a point mass on the draft d, as for n-gram lookup and greedy drafting): accept d
    with probability min(1, p(d) / q(d)) = p(d), which is the chance that the sample
    is d; on rejection draw from norm(max(0, p - q)), which is p without d,
    renormalised: the sample, given that it is not d. So the output is distributed
    exactly as the target's, and a greedy request's tokens are exactly its argmax
    tokens. Returns, per request: the next token and its logprobs, the accepted drafts
    and theirs."""
    next_tokens: list[int] = []
    next_logprobs: list[LogprobsEntry | None] = []
    accepted: list[list[int]] = []
    accepted_logprobs: list[list[LogprobsEntry | None]] = []
    row = 0
    for item in sampling:
        drafts = item.draft_token_ids
        count = 0
        while count < len(drafts) and token_ids[row + count] == drafts[count]:
            count += 1
        accepted.append(list(drafts[:count]))
        accepted_logprobs.append(logprobs[row:row + count])
        next_tokens.append(token_ids[row + count])
        next_logprobs.append(logprobs[row + count])
        row += item.num_sampled_rows
    return next_tokens, next_logprobs, accepted, accepted_logprobs
