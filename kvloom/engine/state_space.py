"""What an engine does differently for a model with state-space (Mamba2) layers.

Such a model's mixers keep one fixed-size state per request (cache/state_pool.py),
so the engine, at start:
- refuses what that state cannot follow yet, naming why: speculative decoding (a
  rejected draft would have to roll every mixer's state back), prefill/decode
  disaggregation (it moves paged KV blocks; the state is not in them) and tensor
  parallel (the mixers are not sharded);
- turns prefix caching off: a cached prefix's KV says nothing about the state a
  mixer had after it, and the state is not checkpointed at block boundaries (the
  alternative, not built): every request computes its prompt from its first token;
- sizes the state pool: ``num_state_slots``, by default ``max_num_seqs``;
- gives a model without attention layers (Mamba2) a KV pool of bookkeeping only:
  the scheduler still counts blocks, which hold nothing (``num_kv_layers`` is 0), so
  there are enough for every slot's request to reach the context length.
"""

from __future__ import annotations

import dataclasses
import logging

from kvloom.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


def refusal(config: EngineConfig, model: ModelConfig) -> str | None:
    """Why this engine cannot serve ``model``'s state-space layers, or None."""
    name = f"{model.architecture} keeps a state per request in its Mamba2 layers"
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
    return config.cache.num_state_slots or config.scheduler.max_num_seqs


def state_space_config(config: EngineConfig, model: ModelConfig, max_model_len: int) -> EngineConfig:
    """``config`` as the engine runs ``model`` (which has state-space layers): prefix
    caching off, and a bookkeeping-only KV pool's size for a model without attention.
    Raises ValueError naming what is not supported."""
    problem = refusal(config, model)
    if problem is not None:
        raise ValueError(problem)
    cache = config.cache
    if cache.enable_prefix_caching:
        logger.info("prefix caching is off: %s has state-space layers, whose state after a prefix "
                    "is not cached (each request computes its prompt from its first token)",
                    model.architecture)
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if model.num_kv_layers == 0 and cache.num_blocks is None:
        blocks_per_request = -(-max_model_len // cache.block_size)
        cache = dataclasses.replace(cache, num_blocks=num_state_slots(config) * blocks_per_request)
    return dataclasses.replace(config, cache=cache)
