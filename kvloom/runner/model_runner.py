"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> logits -> sampled tokens.

The runner never mutates request state; it reads the scheduled requests and returns
one token (or None, for a prefill chunk that does not reach the end) per entry, plus
the tokens a grammar forces after it (jump-forward). Per-request state lives here,
keyed by request id and dropped by ``release``: random generators (so a seeded
request draws the same numbers whatever else is in the batch) and grammar matchers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch, LogprobsEntry, RunnerOutput, SchedulerOutput
from kvloom.models.registry import CausalLM
from kvloom.request import Request, RequestError
from kvloom.runner.prompt_logprobs import prompt_logprobs
from kvloom.runner.sampler import Sampler
from kvloom.runner.sampling_metadata import SamplingMetadata, SamplingRequestState, generator_for_seed
from kvloom.structured.compiler import CompiledGrammar
from kvloom.structured.constraint import StructuredOutput
from kvloom.structured.manager import StructuredOutputManager
from kvloom.tokenizer import Tokenizer


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: torch.Tensor, block_size: int,
                 backend: AttentionBackend[Any], device: torch.device, vocab_size: int,
                 seed: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler(generator_for_seed(seed, device))
        self._generators: dict[str, torch.Generator] = {}
        self.structured = StructuredOutputManager(vocab_size, device)

    # ---- per-request state -----------------------------------------------------------
    def compile_constraint(self, constraint: StructuredOutput | None, tokenizer: Tokenizer,
                           eos_token_ids: Sequence[int]) -> CompiledGrammar | None:
        """Compile (or fetch from the cache) a request's constraint before it is queued.
        Raises ValueError naming the problem for an invalid or unsupported one."""
        return self.structured.compile(constraint, tokenizer, eos_token_ids)

    def add_request(self, request: Request, grammar: CompiledGrammar | None) -> None:
        """Set up a queued request's per-request state (its grammar matcher, if any)."""
        self.structured.add_request(request, grammar)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and grammar matcher."""
        self._generators.pop(request_id, None)
        self.structured.release(request_id)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = generator_for_seed(seed, self.device)
        return generator

    # ---- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        batch = ForwardBatch.build(output, self.block_size, self.device)
        metadata = self.backend.prepare(batch)
        hidden = self.model(batch, self.kv_caches, self.backend, metadata)
        prompt = prompt_logprobs(self.model, hidden, output)
        sampling = [item.request for item in output.scheduled if item.samples]
        if not sampling:
            return RunnerOutput([None] * len(output.scheduled), [None] * len(output.scheduled),
                                prompt_logprobs=prompt)
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()
        rows = [
            SamplingRequestState(
                params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                generator=self._generator_for(request.request_id, request.sampling_params.seed),
                eos_token_ids=request.eos_token_ids,
            )
            for request in sampling
        ]
        # Host-side mask work after the forward is queued: on an accelerator it overlaps
        # the model. None (and no work at all) when no sampling row is constrained.
        failed: dict[str, RequestError] = {}
        grammar = self.structured.grammar_mask(sampling, failed)
        result = self.sampler(
            logits, SamplingMetadata.build(rows, logits.shape[-1], self.device, grammar))
        forced = self.structured.advance(sampling, result.token_ids, failed) if grammar is not None else None
        aligned = self._align(output, result.token_ids, result.logprobs, forced, failed)
        aligned.prompt_logprobs = prompt
        return aligned

    @staticmethod
    def _align(output: SchedulerOutput, token_ids: list[int], logprobs: list[LogprobsEntry | None],
               forced: list[list[int]] | None, failed: dict[str, RequestError]) -> RunnerOutput:
        """Per-sampling-row results -> per-scheduled-entry results (None where no sample)."""
        row_of: list[int | None] = []
        row = 0
        for item in output.scheduled:
            row_of.append(row if item.samples else None)
            row += item.samples
        return RunnerOutput(
            sampled=[None if r is None else token_ids[r] for r in row_of],
            logprobs=[None if r is None else logprobs[r] for r in row_of],
            forced=None if forced is None else [[] if r is None else forced[r] for r in row_of],
            failed=failed,
        )
