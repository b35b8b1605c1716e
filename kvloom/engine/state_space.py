"""What an engine does differently for a model with state-space (Mamba2) layers.

Such a model's mixers keep one fixed-size state per request (cache/state_pool.py),
so the engine, at start:
- refuses what that state cannot follow yet, naming why: speculative decoding (a
  rejected draft would have to roll every mixer's state back), prefill/decode
  disaggregation (it moves paged KV blocks; the state is not in them) and tensor
  parallel (the mixers are not sharded);
- sizes the state pool: ``num_state_slots`` for running requests, by default
  ``max_num_seqs``, and, with prefix caching, ``num_state_checkpoints`` more (by
  default as many) for the radix cache: a cached prefix's KV says nothing about the
  state a mixer had after it, so a hit needs a checkpoint of that state too
  (cache/radix_cache.py), saved where a prompt leaves the cached tree and at its last
  block boundary (cache/kv_manager.py). Checkpoints only at those points, not every
  block: one costs a whole state (megabytes, against kilobytes of KV per block), and a
  prefix ends where the next request branches off, not at every block. With 0
  checkpoints prefix caching is off: every prompt is computed from its first token;
- gives a model without attention layers (Mamba2) a KV pool of bookkeeping only:
  the scheduler still counts blocks, which hold nothing (``num_kv_layers`` is 0), so
  there are enough for every slot's request, and every checkpoint's prefix, to reach
  the context length.
"""

from __future__ import annotations

import dataclasses
import logging

from kvloom.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def refusal(config: EngineConfig, model: ModelConfig) -> str | None:
    """Why this engine cannot serve ``model``'s state-space layers, or None."""
    name = f"{model.architecture} keeps a state per request in its {'Mamba2' if model.ssm else 'short-conv'} layers"
    if config.speculative_config is not None:
        return (f"speculative decoding is not supported for state-space models: {name}, which a "
                "rejected draft would have to roll back (the state pool keeps no checkpoints)")
    if config.kv_transfer.role != "both":
        return (f"role {config.kv_transfer.role!r} (prefill/decode disaggregation) is not supported for "
                f"state-space models: it moves paged KV blocks, and {name}, which is not in them")
    if config.parallel.tensor_parallel_size > 1:
        return (f"tensor_parallel_size > 1 is not supported for state-space models: {name}, and "
                "those layers are not sharded across ranks")
    return None


def num_state_slots(config: EngineConfig) -> int:
    """Slots for running requests."""
    return config.cache.num_state_slots or config.scheduler.max_num_seqs


def num_state_checkpoints(config: EngineConfig) -> int:
    """Slots for the prefix cache's checkpoints, after the requests' (0: caching off)."""
    if not config.cache.enable_prefix_caching:
        return 0
    count = config.cache.num_state_checkpoints
    return num_state_slots(config) if count is None else count


def state_space_config(config: EngineConfig, model: ModelConfig, max_model_len: int) -> EngineConfig:
    """``config`` as the engine runs ``model`` (which has state-space layers): prefix
    caching off without checkpoint slots, and a bookkeeping-only KV pool's size for a
    model without attention. Raises ValueError naming what is not supported."""
    problem = refusal(config, model)
    if problem is not None:
        raise ValueError(problem)
    cache = config.cache
    if cache.enable_prefix_caching and num_state_checkpoints(config) == 0:
        logger.info("prefix caching is off: %s has state-space layers and num_state_checkpoints is 0, "
                    "so no state after a prefix is kept (each request computes its prompt from its "
                    "first token)", model.architecture)
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if model.num_kv_layers == 0 and cache.num_blocks is None:
        blocks_per_request = -(-max_model_len // cache.block_size)
        holders = num_state_slots(config) + num_state_checkpoints(config)
        cache = dataclasses.replace(cache, num_blocks=holders * blocks_per_request)
    return dataclasses.replace(config, cache=cache)
