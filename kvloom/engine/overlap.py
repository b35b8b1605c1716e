"""Overlap scheduling: whether the engine schedules a step before the last one's tokens
are on the host.

Without it a step is schedule -> launch -> wait -> commit, and the device idles while
the host schedules, builds the batch and detokenizes. With it (as SGLang's overlap
scheduler and vLLM's async scheduling do), ``LLMEngine.step`` launches step N, then
commits step N-1 (whose samples are copied to the host behind it) while the device
runs N, so the host's work hides behind the forward:

    host:   schedule N | launch N | commit N-1, outputs | schedule N+1 | launch N+1 | ...
    device:        ...forward N-1 | forward N ............................| forward N+1

Step N was scheduled before N-1's tokens were known: a request that sampled in N-1
has one pending token (``Request.num_pending_tokens``) whose position N computes and
whose value the runner reads from N-1's samples on the device. What this costs: a
request that stops at N-1 (EOS, a stop string) has already been given step N, whose
token is dropped (``max_tokens`` is known in advance and costs nothing). A step with a
request whose next token needs this one's value on the host (a grammar, penalties,
min_tokens, drafts; ``LaunchedStep.overlappable``) is committed before the next is
scheduled.
"""

from __future__ import annotations

from kvloom.config import EngineConfig


def overlap_refusal(config: EngineConfig, on_cuda: bool, tensor_parallel_size: int) -> str | None:
    """Why this engine runs every step to its end before scheduling the next; None:
    it overlaps. ``auto`` overlaps on CUDA only: on the CPU the forward runs on the
    host, so there is nothing to hide behind it."""
    mode = config.overlap_scheduling
    if mode == "off":
        return "overlap_scheduling is off"
    refusal = None
    if config.speculative_config is not None:
        refusal = "speculative decoding proposes from the last token on the host"
    elif tensor_parallel_size > 1:
        refusal = "tensor parallel ranks receive the step's tokens from rank 0's host"
    elif config.kv_transfer.role != "both":
        refusal = "prefill/decode disaggregation stages and pulls KV between steps"
    elif config.scheduler.scheduling == "static":
        refusal = "static batching is the baseline of the synchronous engine"
    elif mode == "auto" and not on_cuda:
        refusal = "the CPU is the device: no forward to overlap (overlap_scheduling 'on' forces it)"
    if refusal is not None and mode == "on":
        raise ValueError(f"overlap_scheduling 'on' cannot be honoured: {refusal}")
    return refusal
