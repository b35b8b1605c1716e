"""Tensor parallel in the runner: rank 0 drives, the other ranks follow.

Rank 0 holds the scheduler, the sampler and every request's state; the other ranks
hold only their shard of the weights and of the KV pool (their heads, the same block
ids). Each step rank 0 sends the one thing a shard needs: the step's ``ForwardBatch``
(flat token ids, positions, slots, block tables, lengths: the compact form of the
``SchedulerOutput``), packed into one int64 tensor. A message is a fixed-size header
on the control group (which may wait indefinitely: an idle engine sends nothing),
then its payload on the step's group:

    FORWARD  header (sizes)  -> payload: the packed batch     every rank copies the step's
                                                              blocks, runs the model (its
                                                              LoRA slots' rows with them)
    LOGITS   header (rows)   -> payload: the rows' hidden     every rank computes its vocab
                                                              columns, gathered on rank 0
    LORA     header (slot)   -> payload: the adapter, JSON    every rank loads its part of
                                                              it into that slot
    STOP     header                                           the ranks leave

``TensorParallelModel`` is rank 0's model: it sends the message, then runs its own
shard, so the runner (and prompt logprobs) call it exactly as a single-process
model. ``serve_rank`` is the other ranks' loop; ``run_worker`` a spawned or
torchrun-started rank's whole life.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention.base import AttentionBackend
from kvloom.attention.registry import backend_for
from kvloom.batch import ForwardBatch
from kvloom.config import EngineConfig, ModelConfig, with_hf_overrides
from kvloom.distributed.errors import RankFailed
from kvloom.distributed.group import TensorParallelGroup
from kvloom.distributed.launch import RankPlacement, agree, join_group, leave_group, rank_device
from kvloom.lora.manager import LoRAManager
from kvloom.lora.request import LoRARequest
from kvloom.models.errors import ModelLoadError
from kvloom.models.registry import CausalLM, load_model
from kvloom.models.sentence_transformers import with_pooler_config
from kvloom.models.sharding import rank_view
from kvloom.runner.device import resolve_device, resolve_dtype
from kvloom.runner.kv_pool import allocate_kv_pool, copy_blocks, device_memory, num_blocks_for

logger = logging.getLogger(__name__)

FORWARD, LOGITS, STOP, LORA = 1, 2, 3, 4
_HEADER = 8  # command, then up to seven sizes


# ---- the step's wire format ---------------------------------------------------------
def pack_batch(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """The sizes (tokens, sequences, table width, logit rows, block copies, LoRA slots,
    LongRoPE flags) and one flat int64 tensor: input ids, positions, slots, block tables,
    sequence lengths, query starts, logit rows, block copies, each sequence's LoRA slot
    (where the step has adapter rows) and long-factor flag (where some sequence has one),
    in that order."""
    device = batch.input_ids.device
    copies = batch.block_copies if batch.block_copies is not None else torch.empty(2, 0, dtype=torch.int64,
                                                                                   device=device)
    lora = torch.tensor(batch.lora_slots or [], dtype=torch.int64, device=device)
    long_rope = torch.tensor(batch.long_rope or [], dtype=torch.int64, device=device)
    parts = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables.flatten(),
             batch.seq_lens, batch.query_start_loc, batch.logits_indices, copies.flatten(), lora, long_rope]
    sizes = [batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1], batch.logits_indices.numel(),
             copies.shape[1], lora.numel(), long_rope.numel()]
    return sizes, torch.cat([part.to(torch.int64) for part in parts])


def unpack_batch(sizes: list[int], flat: torch.Tensor, block_size: int) -> ForwardBatch:
    """``pack_batch``'s inverse: the same tensors (dtypes included) and host lists."""
    seqs, width, num_copies = sizes[1], sizes[2], sizes[4]
    input_ids, positions, slots, tables, seq_lens, starts, logits, copies, lora, long_rope = torch.split(
        flat, _payload_lengths(sizes))
    starts_list = starts.tolist()
    return ForwardBatch(
        input_ids=input_ids, positions=positions, slot_mapping=slots,
        block_tables=tables.view(seqs, width).to(torch.int32), seq_lens=seq_lens.to(torch.int32),
        query_start_loc=starts.to(torch.int32), logits_indices=logits,
        query_lens_list=[b - a for a, b in zip(starts_list, starts_list[1:], strict=False)],
        seq_lens_list=seq_lens.tolist(), block_size=block_size,
        block_copies=copies.view(2, num_copies) if num_copies else None,
        lora_slots=lora.tolist() if lora.numel() else None,
        long_rope=[bool(flag) for flag in long_rope.tolist()] if long_rope.numel() else None)


def _header(command: int, sizes: Iterable[int] = ()) -> torch.Tensor:
    values = [command, *sizes]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64)


# ---- rank 0 -----------------------------------------------------------------------
class TensorParallelModel:
    """Rank 0's model under tensor parallel: each forward and each logits call first
    tells the other ranks to do the same, then runs this rank's shard. A collective
    that fails (a rank died, or timed out) raises here: an engine fault."""

    def __init__(self, model: CausalLM, group: TensorParallelGroup) -> None:
        self.model = model
        self.group = group
        self._stopped = False
        self._broken = False

    def __call__(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                 metadata: Any) -> torch.Tensor:
        with self._collectives():
            sizes, flat = pack_batch(batch)
            self.group.broadcast(_header(FORWARD, sizes), control=True)
            self.group.broadcast(flat.to(self.group.device))
            return self.model(batch, kv_caches, backend, metadata)

    def load_lora(self, slot: int, lora: LoRARequest) -> None:
        """Tell the other ranks to load their part of ``lora`` into ``slot`` (rank 0's
        LoRAManager has loaded its own; ``LoRAManager.on_load``)."""
        with self._collectives():
            text = json.dumps({"name": lora.lora_name, "id": lora.lora_int_id, "path": lora.lora_path}).encode()
            self.group.broadcast(_header(LORA, [slot, len(text)]), control=True)
            self.group.broadcast(torch.tensor(list(text), dtype=torch.int64, device=self.group.device))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._collectives():
            hidden = hidden.contiguous()
            self.group.broadcast(_header(LOGITS, [hidden.shape[0]]), control=True)
            self.group.broadcast(hidden)
            return self.model.compute_logits(hidden)

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """A failed collective leaves the group broken: nothing may be sent on it again
        (gloo aborts the process on a second use of a dead connection)."""
        if self._broken:
            raise RuntimeError("the tensor-parallel group failed earlier: the engine must restart")
        try:
            yield
        except RuntimeError:
            self._broken = True
            raise

    def stop(self) -> None:
        """Tell the other ranks to leave (once; not on a broken group, whose ranks have
        seen the failure too)."""
        if self._stopped or self._broken:
            return
        self._stopped = True
        with self._collectives():
            self.group.broadcast(_header(STOP), control=True)

    # The rest of CausalLM: this rank's shard answers.
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)

    def weight_slice(self, hf_name: str) -> Any:
        return self.model.weight_slice(hf_name)

    def pack_weights(self, matmul: str = "invariant") -> int:
        return self.model.pack_weights(matmul)

    def use_native_stack(self) -> str | None:
        return self.model.use_native_stack()

    def first_layers(self, num_layers: int) -> CausalLM:
        raise ValueError("layer_skip drafts cannot run on a tensor-parallel model")

    def to(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.to(*args, **kwargs)

    def eval(self) -> Any:
        return self.model.eval()


# ---- every rank: its shard ----------------------------------------------------------------
@dataclass
class RankShard:
    """One rank's part of the engine: the model's shard, and its KV pool (its heads of
    every block) with the attention backend over it."""

    model: CausalLM
    kv_caches: torch.Tensor
    backend: AttentionBackend[Any]
    num_blocks: int


def max_model_len_for(config: EngineConfig, model: ModelConfig) -> int:
    """The context length: the configured one, else the model's positions. A configured
    length past them is refused, as vLLM does, rather than quietly served shorter. (A
    sliding window is attended as one in the Llama family's layers; latent attention and
    the state-space hybrids have none, and are served within any they declare.)"""
    limit = model.max_position_embeddings
    if model.sliding_window is not None and (model.mla is not None or model.keeps_state):
        limit = min(limit, model.sliding_window)
    if config.max_model_len is not None and config.max_model_len > limit:
        what = (f"its sliding window of {limit} tokens (this family attends to whole contexts only)"
                if limit < model.max_position_embeddings else f"its {limit} positions")
        raise ModelLoadError(f"max_model_len {config.max_model_len} is longer than the model allows: {what}")
    return config.max_model_len or limit


def fitting_blocks(config: EngineConfig, model: ModelConfig, group: TensorParallelGroup,
                   device: torch.device, dtype: torch.dtype) -> int:
    """KV blocks of this rank's heads that fit in its memory (the group takes the least)."""
    memory = (device_memory(device) if config.cache.gpu_memory_utilization is not None
              and config.cache.num_blocks is None else None)
    return num_blocks_for(config.cache, rank_view(model, group.size), dtype, memory)


def build_pool(config: EngineConfig, model: ModelConfig, group: TensorParallelGroup, num_blocks: int,
               device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, AttentionBackend[Any]]:
    """This rank's KV pool (its KV heads, ``num_blocks`` blocks) and attention backend."""
    local = rank_view(model, group.size)
    kv_caches = allocate_kv_pool(local, num_blocks, config.cache.block_size, dtype, device)
    return kv_caches, backend_for(local, config.attention_backend, device)


def load_shard(config: EngineConfig, group: TensorParallelGroup, device: torch.device, dtype: torch.dtype,
               load: Callable[[], tuple[ModelConfig, CausalLM]]) -> tuple[ModelConfig, RankShard]:
    """This rank's shard, on every rank alike: ``load`` its model (every rank on its own),
    then meet the others once (``agree``: so a rank that failed, or differs, fails them
    all), then build a pool of the fewest blocks any rank fits. A rank's own failure is
    raised as itself; another rank's as RankFailed naming it."""
    model_config: ModelConfig | None = None
    model: CausalLM | None = None
    own_blocks, error = 0, None
    try:
        model_config, model = load()
        own_blocks = fitting_blocks(config, model_config, group, device, dtype)
    except Exception as failure:  # noqa: BLE001 - the others must hear of it before it is raised
        error = failure
    try:
        reports = agree(group, startup_report(config, model_config, own_blocks, error))
    except RankFailed:
        if error is not None:
            raise error from None
        raise
    if error is not None:  # one process: nobody to tell
        raise error
    assert model is not None and model_config is not None
    num_blocks = min(report["num_blocks"] for report in reports)
    kv_caches, backend = build_pool(config, model_config, group, num_blocks, device, dtype)
    return model_config, RankShard(model, kv_caches, backend, num_blocks)


def startup_report(config: EngineConfig, model: ModelConfig | None, num_blocks: int,
                   error: BaseException | None) -> dict[str, Any]:
    """What a rank tells the others at start (``agree``): its error, and what must match."""
    return {"error": None if error is None else f"{type(error).__name__}: {error}",
            "model": None if model is None else repr(model), "dtype": config.dtype,
            "block_size": config.cache.block_size, "max_model_len": config.max_model_len,
            "matmul": config.matmul, "num_blocks": num_blocks}


def serve_rank(group: TensorParallelGroup, shard: RankShard, hidden_size: int, dtype: torch.dtype,
               block_size: int, lora: LoRAManager | None = None) -> None:
    """A rank other than 0: run what rank 0 sends until STOP. Returns after STOP; a
    failed collective (rank 0 died) raises. ``lora``: this rank's adapter slots
    (enable_lora), which follow rank 0's loads."""
    with torch.inference_mode():
        while True:
            header = group.broadcast(_header(0), control=True).tolist()
            command, sizes = header[0], header[1:]
            if command == STOP:
                return
            if command == FORWARD:
                flat = torch.empty(sum(_payload_lengths(sizes)), dtype=torch.int64, device=group.device)
                batch = unpack_batch(sizes[:7], group.broadcast(flat), block_size)
                if batch.block_copies is not None:  # as rank 0's runner did before its forward
                    copy_blocks(shard.kv_caches, batch.block_copies)
                if batch.lora_slots is not None:
                    assert lora is not None, "rank 0 sent adapter rows to a rank without LoRA"
                    lora.step.begin(batch.lora_slots, batch.query_lens_list, group.device)
                try:
                    shard.model(batch, shard.kv_caches, shard.backend, shard.backend.prepare(batch))
                finally:
                    if lora is not None:
                        lora.step.end()
            elif command == LOGITS:
                hidden = torch.empty(sizes[0], hidden_size, dtype=dtype, device=group.device)
                shard.model.compute_logits(group.broadcast(hidden))
            elif command == LORA:
                text = group.broadcast(torch.empty(sizes[1], dtype=torch.int64, device=group.device))
                spec = json.loads(bytes(text.tolist()).decode())
                assert lora is not None, "rank 0 sent an adapter to a rank without LoRA"
                with torch.inference_mode(False):  # as rank 0 loads it: its weights are ordinary tensors
                    lora.mirror(sizes[0], LoRARequest(spec["name"], spec["id"], spec["path"]))
            else:
                raise RuntimeError(f"tensor-parallel rank {group.rank}: unknown command {command}")


def _payload_lengths(sizes: list[int]) -> list[int]:
    tokens, seqs, width, rows, copies, lora, long_rope = sizes[:7]
    return [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, rows, 2 * copies, lora, long_rope]


def run_worker(config: EngineConfig, placement: RankPlacement) -> None:
    """A rank > 0 from start to STOP: join the group, load this rank's shard, agree
    with the others, then follow rank 0's steps. Spawned by rank 0 or started by
    torchrun (kvloom/cli.py). Raises RankFailed when the group cannot start."""
    from kvloom.models.loader import load_checkpoint

    if placement.size != config.parallel.tensor_parallel_size:  # rank 0 refuses the same way
        raise RankFailed(f"torchrun started this process as rank {placement.rank} of {placement.size}, "
                         f"but tensor_parallel_size is {config.parallel.tensor_parallel_size}")
    device = rank_device(resolve_device(config.device), placement)
    dtype = resolve_dtype(config.dtype, device)
    group = join_group(config, placement, device)

    def load() -> tuple[ModelConfig, CausalLM]:
        checkpoint = load_checkpoint(config.model, revision=config.revision)
        checkpoint.hf_config = with_hf_overrides(checkpoint.hf_config, config.hf_overrides)  # as rank 0's
        checkpoint.hf_config = with_pooler_config(checkpoint.hf_config, checkpoint.path, config.pooler_config)
        model_config = ModelConfig.from_hf(checkpoint.hf_config)
        return model_config, load_model(model_config, max_model_len_for(config, model_config), checkpoint,
                                        device, dtype, config.matmul, config.decoder_stack == "native", group)

    try:
        model_config, shard = load_shard(config, group, device, dtype, load)
        lora = (LoRAManager(shard.model, model_config, config.lora.max_loras, config.lora.max_lora_rank,
                            config.matmul, max_cpu_loras=config.lora.num_cpu_loras)
                if config.lora.enable_lora else None)
        serve_rank(group, shard, model_config.hidden_size, dtype, config.cache.block_size, lora)
    finally:
        leave_group(group, [])


def worker_main(config: EngineConfig, placement: RankPlacement) -> int:
    """A worker rank's process (spawned, or kvloom's CLI under torchrun): ``run_worker``
    with its failures as one line each and an exit status (0 after STOP, 1 when the
    group could not start or another rank went away mid-step)."""
    try:
        run_worker(config, placement)
    except RankFailed as error:  # another rank failed to start, or differs
        logger.error("%s", error)
        return 1
    except RuntimeError as error:  # a collective failed: another rank died or timed out
        logger.error("tensor-parallel rank %d of %d stops: %s", placement.rank, placement.size,
                     str(error).splitlines()[0])
        return 1
    except Exception as error:  # noqa: BLE001 - its own start failed (rank 0 reports it too)
        logger.error("tensor-parallel rank %d of %d could not start: %s: %s", placement.rank, placement.size,
                     type(error).__name__, error)
        return 1
    return 0


def _spawned_worker(config: EngineConfig, placement: RankPlacement) -> None:
    import sys

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{placement.rank} "
                                                   "%(name)s: %(message)s")
    sys.exit(worker_main(config, placement))


@dataclass
class FirstRank:
    """What the engine (rank 0) holds: its model (a ``TensorParallelModel`` when there
    are other ranks), its pool, the group, and the rank processes it spawned."""

    shard: RankShard
    group: TensorParallelGroup
    processes: list[Any]
    device: torch.device  # this rank's (a CUDA rank's is the GPU of its local rank)

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (no-op for one process)."""
        if self.group.size == 1:
            return
        if isinstance(self.shard.model, TensorParallelModel):
            self.shard.model.stop()
        leave_group(self.group, self.processes)


def load_first_rank(config: EngineConfig, model_config: ModelConfig, checkpoint: Any,
                    device: torch.device, dtype: torch.dtype, max_model_len: int) -> FirstRank:
    """The engine's model and KV pool: in this process alone, or as rank 0 of
    ``tensor_parallel_size`` (spawning the others here, or joining torchrun's group).
    A model the size cannot split is refused before any rank starts; a rank that fails
    to start fails the engine with that rank's error."""
    from kvloom.distributed.group import SINGLE_PROCESS
    from kvloom.distributed.launch import spawn_workers, torchrun_placement
    from kvloom.models.sharding import tensor_parallel_problem

    size = config.parallel.tensor_parallel_size
    problem = tensor_parallel_problem(model_config, size, config.parallel.enable_expert_parallel)
    if problem is None and config.parallel.distributed_backend == "nccl" and device.type != "cuda":
        problem = f"distributed_backend nccl runs on CUDA devices only, not {device.type}: use gloo (or auto)"
    if problem is not None:
        raise ValueError(problem)
    placement = torchrun_placement()
    if placement is not None and (placement.size != size or placement.rank != 0):
        raise ValueError(f"torchrun started this process as rank {placement.rank} of {placement.size}, "
                         f"but tensor_parallel_size is {size}: start {size} ranks, and build the "
                         "engine on rank 0 only (kvloom serve / generate run the other ranks' loop)")
    native = config.decoder_stack == "native"
    if size == 1:
        _, shard = load_shard(config, SINGLE_PROCESS, device, dtype, lambda: (model_config, load_model(
            model_config, max_model_len, checkpoint, device, dtype, config.matmul, native)))
        return FirstRank(shard, SINGLE_PROCESS, [], device)
    processes: list[Any] = []
    if placement is None:
        placement, processes = spawn_workers(config, _spawned_worker)
    device = rank_device(device, placement)
    group: TensorParallelGroup | None = None
    try:
        group = joined = join_group(config, placement, device)
        _, shard = load_shard(config, joined, device, dtype, lambda: (model_config, load_model(
            model_config, max_model_len, checkpoint, device, dtype, config.matmul, native, joined)))
        shard.model = TensorParallelModel(shard.model, group)
        logger.info("tensor parallel: rank 0 of %d (%s), %d KV blocks of this rank's %d KV heads",
                    size, placement.init_method, shard.num_blocks, model_config.num_kv_heads // size)
        return FirstRank(shard, group, processes, device)
    except BaseException:
        for process in processes:
            process.terminate()
        leave_group(group, processes, timeout=10)
        raise
