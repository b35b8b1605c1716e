"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> logits -> sampled tokens.

The runner never mutates request state; it reads the scheduled requests and returns
one token (or None, for a prefill chunk that does not reach the end) per entry.
Per-request random generators live here, keyed by request id, so a seeded request
draws the same numbers whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.engine.output import SchedulerOutput
from kvloom.runner.forward_batch import ForwardBatch
from kvloom.runner.sampler import Sampler
from kvloom.runner.sampling_metadata import SamplingMetadata, SamplingRequestState


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]  # aligned with SchedulerOutput.scheduled
    logprobs: list[object | None]  # sampler's LogprobsEntry where requested


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: torch.Tensor, block_size: int,
                 backend: AttentionBackend, device: torch.device, vocab_size: int,
                 seed: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.vocab_size = vocab_size
        default_generator = torch.Generator(device=device)
        default_generator.manual_seed(seed)
        self.sampler = Sampler(default_generator)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        batch = ForwardBatch.build(output, self.block_size, self.device)
        metadata = self.backend.prepare(batch)
        hidden = self.model(batch, self.kv_caches, self.backend, metadata)
        sampling = [item for item in output.scheduled if item.samples]
        if not sampling:
            return RunnerOutput([None] * len(output.scheduled), [None] * len(output.scheduled))
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()
        rows = [
            SamplingRequestState(
                params=item.request.sampling_params,
                prompt_token_ids=item.request.prompt_token_ids,
                output_token_ids=item.request.output_token_ids,
                generator=self._generator_for(item.request.request_id,
                                              item.request.sampling_params.seed),
                eos_token_ids=item.request.eos_token_ids,
            )
            for item in sampling
        ]
        result = self.sampler(logits, SamplingMetadata.build(rows, logits.shape[-1], self.device))
        tokens = iter(result.token_ids)
        logprobs = iter(result.logprobs)
        sampled: list[int | None] = []
        entries: list[object | None] = []
        for item in output.scheduled:
            sampled.append(next(tokens) if item.samples else None)
            entries.append(next(logprobs) if item.samples else None)
        return RunnerOutput(sampled, entries)
