"""Draft-model proposers: a small model (``draft``) or the target's first layers
(``layer_skip``) guesses the next tokens greedily, run as a batched engine of its own.

The draft keeps a shadow ``Request`` per target request: the same token ids plus the
drafts it guessed last time, its own ``num_computed_tokens`` and its own blocks in its
own paged KV pool (as many blocks as the target's, each holding the draft's layers
only). Each call, per request:

1. **Sync and roll back.** The target has verified some of the drafts and appended
   its own token; the shadow keeps its KV up to where its tokens still agree with the
   target's (``num_computed_tokens`` moves back, blocks past it return to the pool).
2. **Catch up** in chunks of at most the engine's token budget: prompt and newly
   verified tokens, batched across requests; the last position's argmax is draft 1.
3. **Decode** drafts 2..k, one batched step each.

A request whose KV no longer fits the draft's pool is dropped from it (its blocks
freed; it goes without drafts this step and starts over next time): the draft's own
preemption, which never touches the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvloom.attention.registry import backend_for
from kvloom.batch import ScheduledRequest, SchedulerOutput
from kvloom.cache.block_pool import BlockPool
from kvloom.cache.kv_manager import KVCacheManager
from kvloom.cache.prefix_cache import NoPrefixCache
from kvloom.config import ModelConfig
from kvloom.lora.manager import LoRAManager
from kvloom.models.loader import load_checkpoint
from kvloom.models.registry import CausalLM, load_model
from kvloom.request import Request
from kvloom.runner.kv_pool import allocate_kv_pool
from kvloom.runner.model_runner import ModelRunner
from kvloom.sampling_params import SamplingParams
from kvloom.speculative.proposer import TargetModel

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, name: str, model: CausalLM, model_config: ModelConfig, target: TargetModel,
                 draft_cost: float, shares_layers: bool = False) -> None:
        self.name = name
        self.draft_cost = draft_cost
        self.shares_layers = shares_layers  # the target's own layers (layer_skip), not a model of its own
        block_size = target.config.cache.block_size
        self.kv = KVCacheManager(BlockPool(target.num_blocks), block_size, NoPrefixCache())
        kv_caches = allocate_kv_pool(model_config, target.num_blocks, block_size, target.dtype, target.device)
        backend = backend_for(model_config, target.config.attention_backend, target.device)
        self.runner = ModelRunner(model, kv_caches, block_size, backend, target.device,
                                  model_config.vocab_size, seed=0)
        self.token_budget = target.config.scheduler.max_num_batched_tokens
        self.max_model_len = target.max_model_len
        self._shadows: dict[str, Request] = {}
        self._verified: dict[str, int] = {}  # tokens known to agree with the target's
        self.num_dropped = 0  # shadows dropped because the draft's pool was full

    # ---- per request -----------------------------------------------------------------
    def release(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        self._verified.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def check_integrity(self) -> None:
        """Every block of the draft's pool is held by exactly the live shadows."""
        self.kv.check_integrity(list(self._shadows.values()))

    def use_adapters(self, lora: LoRAManager) -> None:
        """A layer_skip draft runs the target's own first layers, their LoRA wrappers
        included: its forwards take each request's adapter slot (a shadow has its
        request's id), in the walk too. A separate draft model has no adapters."""
        if not self.shares_layers:
            return
        self.runner.lora = lora
        stack = getattr(self.runner.model, "native_stack", None)
        if stack is not None:
            lora.add_stack(stack)

    def _synced(self, request: Request) -> Request:
        """The request's shadow, rolled back to where it agrees with the target."""
        tokens = request.all_token_ids
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, list(tokens), _GREEDY, max_model_len=self.max_model_len)
            self._shadows[request.request_id] = shadow
        else:
            agree = self._verified[request.request_id]  # verified tokens never change
            guessed = shadow.all_token_ids
            limit = min(len(guessed), len(tokens))
            while agree < limit and guessed[agree] == tokens[agree]:
                agree += 1
            # At least the last token is recomputed: its logits give the first draft.
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree, len(tokens) - 1)
            shadow.all_token_ids = list(tokens)
            self.kv.release_uncomputed(shadow)
        self._verified[request.request_id] = len(tokens)
        return shadow

    def _drop(self, shadow: Request) -> None:
        self.num_dropped += 1
        self.release(shadow.request_id)

    # ---- one proposal ----------------------------------------------------------------
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        shadows = [self._synced(request) for request in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, count in enumerate(num_tokens) if count > 0]
        # Catch up: every shadow computes its uncomputed tokens, in budget-sized steps.
        pending = live
        while pending:
            budget, batch, waiting = self.token_budget, [], []
            for i in pending:
                shadow = shadows[i]
                count = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
                if count <= 0:
                    waiting.append(i)
                elif not self.kv.allocate_slots(shadow, count):
                    self._drop(shadow)
                else:
                    batch.append((i, ScheduledRequest.of(shadow, shadow.num_computed_tokens, count)))
                    budget -= count
            pending = waiting + [i for i, token in self._run(batch, shadows, drafts) if token is None]
        # Decode: one more draft per step for the requests that want more.
        for round_ in range(1, max(num_tokens, default=0)):
            batch = []
            for i in live:
                if len(drafts[i]) == round_ and num_tokens[i] > round_:
                    shadow = shadows[i]
                    shadow.all_token_ids.append(drafts[i][-1])  # a guess: rolled back next time
                    if self.kv.allocate_slots(shadow, 1):
                        batch.append((i, ScheduledRequest.of(shadow, shadow.num_computed_tokens, 1)))
                    else:
                        self._drop(shadow)
            if not batch:
                break
            self._run(batch, shadows, drafts)
        return drafts

    def _run(self, batch: list[tuple[int, ScheduledRequest]], shadows: list[Request],
             drafts: list[list[int]]) -> list[tuple[int, int | None]]:
        """One draft forward over ``batch``; returns (request index, token or None)."""
        if not batch:
            return []
        result = self.runner.execute(SchedulerOutput(0, [item for _, item in batch]))
        tokens = []
        for (i, item), token in zip(batch, result.sampled, strict=True):
            shadows[i].num_computed_tokens += item.num_new_tokens
            if token is not None:
                drafts[i].append(token)
            tokens.append((i, token))
        return tokens


def build_draft(target: TargetModel) -> DraftModelProposer:
    """``draft``: the model at ``speculative_config.model``, with the target's vocabulary."""
    spec = target.config.speculative_config
    assert spec is not None and spec.model is not None
    checkpoint = load_checkpoint(spec.model)
    config = ModelConfig.from_hf(checkpoint.hf_config)
    if config.vocab_size != target.model_config.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {config.vocab_size} "
                         f"tokens, the target's has {target.model_config.vocab_size}: a draft model must "
                         "share the target's tokenizer")
    if config.max_position_embeddings < target.max_model_len:
        raise ValueError(f"speculative_config.model {spec.model!r} handles {config.max_position_embeddings} "
                         f"positions, fewer than the target's context of {target.max_model_len}")
    model = load_model(config, target.max_model_len, checkpoint, target.device, target.dtype,
                       target.config.matmul, target.config.decoder_stack == "native")
    # A decode step streams the weights: a draft step costs its share of the weights.
    return DraftModelProposer("draft", model, config, target,
                              _weights_read(config) / _weights_read(target.model_config))


def build_layer_skip(target: TargetModel) -> DraftModelProposer:
    """``layer_skip``: the target's first ``num_layers`` layers, final norm and head."""
    spec = target.config.speculative_config
    assert spec is not None and spec.num_layers is not None
    model = target.model.first_layers(spec.num_layers)
    if target.config.decoder_stack == "native" and target.device.type == "cpu":
        model.use_native_stack()  # over the shared, already packed layers
    config = dataclasses.replace(target.model_config, num_layers=spec.num_layers)
    return DraftModelProposer("layer_skip", model, config, target,
                              spec.num_layers / target.model_config.num_layers, shares_layers=True)


def _weights_read(config: ModelConfig) -> int:
    """Weights a decode step reads: every layer's projections and the output head."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = config.hidden_size * (q + 2 * kv) + q * config.hidden_size \
        + 3 * config.hidden_size * config.intermediate_size
    return config.num_layers * layer + config.vocab_size * config.hidden_size
