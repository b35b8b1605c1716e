"""`kvloom bench offline`: in-process throughput through the engine, plus KV utilisation.

KV utilisation = tokens whose KV is held / token slots in allocated blocks, averaged
over steps; it is the number behind the paged cache's "waste under 4%" claim, and the
static (max-length preallocation) baseline shows what it replaces.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from tqdm import tqdm

from kvloom.bench.datasets import BenchRequest
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class OfflineResult:
    label: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    steps: int
    mean_kv_utilisation: float
    num_preemptions: int
    # Speculative decoding: draft tokens verified and accepted, verifications.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification: accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_json(self) -> dict:
        return {**asdict(self), "output_throughput": self.output_throughput,
                "total_throughput": self.total_throughput, "prefix_hit_rate": self.prefix_hit_rate,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def kv_utilisation(engine: LLMEngine) -> float | None:
    """Held KV tokens / slots of the blocks the running requests hold (None if none);
    under a sliding window, of the blocks they have not let go."""
    kv = engine.kv_manager
    running = engine.scheduler.running
    held = [kv.num_held_blocks(r) for r in running]
    slots = sum(held) * kv.block_size
    if slots == 0:
        return None
    let_go = sum(len(r.block_ids) - n for r, n in zip(running, held, strict=True)) * kv.block_size
    return (sum(r.num_computed_tokens for r in running) - let_go) / slots


def warm_up(engine: LLMEngine) -> None:
    """One short untimed request so one-time costs (oneDNN kernel selection, allocator
    growth) do not land in the first measured mode."""
    engine.add_request([1] * 64, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_offline(engine: LLMEngine, requests: list[BenchRequest], label: str,
                ignore_eos: bool = True, show_progress: bool = True, lead: int = 0) -> OfflineResult:
    """Submit every request at once and step the engine until all finish. With ``lead``,
    the first ``lead`` requests go first and the rest only once those have their first
    token (inside the timed run): a shared prompt is then cached before the others ask
    for it, as with OpenVINO GenAI's staggered submission in shared/peers."""
    def submit(batch: list[BenchRequest], kind: RequestOutputKind) -> None:
        for item in batch:
            params = SamplingParams(max_tokens=item.expected_output_len, temperature=0.0,
                                    ignore_eos=ignore_eos, output_kind=kind)
            engine.add_request(item.prompt_token_ids or item.prompt, params)

    scheduler = engine.scheduler
    before = (scheduler.num_preemptions, scheduler.num_draft_tokens, scheduler.num_accepted_tokens,
              scheduler.num_verifications)
    steps, utilisation, finished, prompt_tokens, output_tokens, cached_tokens = 0, [], 0, 0, 0, 0
    waiting = requests[lead:] if lead > 0 else []
    started = 0  # requests that have produced a token, while the rest wait
    # Only finished outputs are counted, as LLM.generate returns them; the lead requests
    # report their first token, for which the others wait.
    if lead > 0:
        submit(requests[:lead], RequestOutputKind.CUMULATIVE)  # before the clock, as it always was
    else:
        submit(requests, RequestOutputKind.FINAL_ONLY)
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=label, unit="req", disable=not show_progress) as bar:
        while engine.has_unfinished_requests() or waiting:
            if waiting and (started >= lead or not engine.has_unfinished_requests()):
                submit(waiting, RequestOutputKind.FINAL_ONLY)
                waiting = []
            outputs = engine.step()
            steps += 1
            value = kv_utilisation(engine)
            if value is not None:
                utilisation.append(value)
            for output in outputs:
                if waiting and len(output.outputs[0].token_ids) == 1:
                    started += 1
                if output.finished:
                    finished += 1
                    prompt_tokens += len(output.prompt_token_ids)
                    output_tokens += len(output.outputs[0].token_ids)
                    cached_tokens += output.num_cached_tokens
                    bar.update(1)
    elapsed = time.perf_counter() - start
    after = (scheduler.num_preemptions, scheduler.num_draft_tokens, scheduler.num_accepted_tokens,
             scheduler.num_verifications)
    deltas = [now - then for now, then in zip(after, before, strict=True)]
    return OfflineResult(label, finished, prompt_tokens, output_tokens, elapsed, steps,
                         sum(utilisation) / max(1, len(utilisation)), *deltas, cached_prompt_tokens=cached_tokens)


def format_table(results: list[OfflineResult]) -> str:
    header = (f"{'mode':<14}{'reqs':>6}{'out tok':>9}{'time s':>9}{'out tok/s':>11}"
              f"{'tot tok/s':>11}{'steps':>7}{'KV util':>9}{'preempt':>9}{'cached':>8}")
    speculative = any(r.num_draft_tokens for r in results)
    if speculative:
        header += f"{'accept':>8}{'len':>6}"
    lines = [header, "-" * len(header)]
    for r in results:
        line = (f"{r.label:<14}{r.num_requests:>6}{r.output_tokens:>9}{r.elapsed_s:>9.1f}"
                f"{r.output_throughput:>11.1f}{r.total_throughput:>11.1f}{r.steps:>7}"
                f"{r.mean_kv_utilisation:>9.1%}{r.num_preemptions:>9}{r.prefix_hit_rate:>8.1%}")
        if speculative:  # the acceptance rate and the mean accepted length
            rate, length = r.acceptance_rate, r.mean_accepted_length
            line += f"{rate:>8.1%}{length:>6.2f}" if rate is not None and length is not None else f"{'-':>8}{'-':>6}"
        lines.append(line)
    return "\n".join(lines)


def save_results(path: str, results: list[OfflineResult], meta: dict) -> None:
    """``meta`` may hold the engine's parsed options, some of them configs
    (``--speculative-config``): those are written as their fields."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.to_json() for r in results]}, f, indent=2, default=_config_fields)


def _config_fields(value: Any) -> dict[str, Any]:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
