"""A model-free runner for scheduler tests: the next token is a pure function of the
request's last token, so outputs are known in advance and independent of batching."""

from __future__ import annotations

from kvloom.batch import RunnerOutput, SchedulerOutput
from kvloom.cache.block_pool import BlockPool
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.prefix_cache import NoPrefixCache
from kvloom.cache.radix_cache import RadixCache
from kvloom.config import SchedulerConfig
from kvloom.engine.admission import AdmissionLimits
from kvloom.engine.policy import make_policy
from kvloom.engine.scheduler import Scheduler, StaticBatchScheduler
from kvloom.engine.stop import StopChecker
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams

VOCAB = 1000


def next_token(last: int) -> int:
    return (last * 7 + 3) % VOCAB


def make_scheduler(num_blocks: int = 64, block_size: int = 4, prefix_cache: bool = False,
                   max_model_len: int = 1 << 20, stops: StopChecker | None = None, window: int = 0,
                   **config) -> Scheduler:
    """``window``: a sliding window in every layer (the KV manager lets go behind it)."""
    cfg = SchedulerConfig(**config)
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, block_size) if prefix_cache else NoPrefixCache()
    kv = KVCacheManager(pool, block_size, cache, window)
    cls = StaticBatchScheduler if cfg.scheduling == "static" else Scheduler
    limits = AdmissionLimits(max_model_len, VOCAB, num_blocks, block_size, window=window,
                             chunk_tokens=cfg.max_num_batched_tokens)
    return cls(cfg, kv, make_policy(cfg), limits, stops)


def make_request(request_id: str, prompt_len: int, max_tokens: int, priority: int = 0,
                 first_token: int = 1) -> Request:
    prompt = [(first_token + i) % VOCAB for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   priority=priority)


def fake_execute(output: SchedulerOutput) -> RunnerOutput:
    """What a model would sample: only for chunks that reach the end of known tokens."""
    sampled = [next_token(item.request.all_token_ids[-1]) if item.samples else None
               for item in output.scheduled]
    return RunnerOutput(sampled, [None] * len(sampled))


def expected_output(request: Request) -> list[int]:
    tokens, last = [], request.prompt_token_ids[-1]
    for _ in range(request.sampling_params.max_tokens):
        last = next_token(last)
        tokens.append(last)
    return tokens


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000,
                      on_step=None) -> list[SchedulerOutput]:
    """Step until idle, checking allocator integrity after every step."""
    log = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return log
        output = scheduler.schedule()
        scheduler.update(output, fake_execute(output))
        scheduler.check_integrity()
        log.append(output)
        if on_step is not None:
            on_step(output)
    raise AssertionError("scheduler did not finish (livelock?)")
