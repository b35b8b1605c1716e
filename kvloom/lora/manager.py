"""LoRAManager: which adapter sits in which of the model's ``max_loras`` slots.

A request's adapter is checked and its name bound to its path when the request is
queued (``bind``); the adapter is loaded into a slot when the scheduler admits the
request (``hold``) and stays there while requests of it run (a reference each); an idle
adapter stays loaded until its slot is needed, least recently used first. A request
whose adapter would need a slot when every slot holds an adapter of running requests
waits in the queue, as vLLM's, until one drains (engine/scheduler.py). Integrity: every
slot's references equal the running requests that hold it.

Under tensor parallel each rank holds its part of every adapter, cut as the model's own
weights are (models/sharding.py): a column-parallel projection's B by its output rows,
a row-parallel one's A by its input columns, so that each rank's delta to o and down is
a partial sum the layer's all-reduce completes. Rank 0's manager picks the slots and
tells the other ranks' (``on_load``; their ``mirror``) before any step uses them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch

from kvloom.config import ModelConfig
from kvloom.lora.adapter import TARGETS, CheckpointNames, LoRAAdapter, LoRAError
from kvloom.lora.layers import LoRAExperts, LoRALinear, LoRAStep
from kvloom.lora.native import stack_table
from kvloom.lora.request import LoRARequest
from kvloom.models.decoder_stack import NativeDecoderStack
from kvloom.models.sharding import column_split, llama_weight_slice
from kvloom.request import Request

# What an adapter's tensors load into: a projection's LoRALinear, or an expert layer's LoRAExperts.
LoRATarget = LoRALinear | LoRAExperts


def wrap_llama_layers(model: object, config: ModelConfig, max_loras: int, max_rank: int,
                      step: LoRAStep, matmul: str = "invariant"
                      ) -> dict[tuple[int, str], tuple[LoRATarget, int]]:
    """Wrap each decoder layer's projections of a model of the Llama-layer families (after
    packing) in ``LoRALinear``: the attention's everywhere, the MLP's where the layer is dense
    (gated, or un-gated as Phi's, GPT-2's, GPT-NeoX's and StarCoder2's fc1 and fc2: up and down
    to an adapter); a mixture-of-experts layer's routed experts get a ``LoRAExperts``
    (``experts.gate_up_proj`` part 0, ``experts.down_proj`` part 1). Returns (layer,
    projection) -> (what holds its adapters, its part)."""
    from kvloom.models.layers import GatedMLP, UngatedMLP
    from kvloom.models.llama import LlamaForCausalLM
    from kvloom.models.moe import SparseMoE
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"LoRA serves the families of Llama's layers (Llama, Qwen, Mistral, Gemma, Phi, GPT-2, ..., "
                         f"and the attention of Mixtral's and Qwen-MoE's), not {config.architecture}")
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    hidden = config.hidden_size
    targets: dict[tuple[int, str], tuple[LoRATarget, int]] = {}

    def wrap(owner: torch.nn.Module, attribute: str, layer: int, parts: list[tuple[str, int, int]],
             in_features: int) -> None:
        wrapped = LoRALinear(getattr(owner, attribute), parts, in_features, max_loras, max_rank, step, dtype, device,
                             matmul)
        setattr(owner, attribute, wrapped)
        for index, (name, _, _) in enumerate(parts):
            targets[layer, name] = (wrapped, index)

    for index, layer in enumerate(model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        q, kv = attention.q_size, attention.kv_size  # this rank's heads (all of them without TP)
        wrap(attention, "qkv_proj", index, [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], hidden)
        wrap(attention, "o_proj", index, [("o_proj", 0, hidden)], q)
        if isinstance(mlp, GatedMLP):
            inter = mlp.intermediate_size  # this rank's features
            wrap(mlp, "gate_up_proj", index, [("gate_proj", 0, inter), ("up_proj", inter, inter)], hidden)
            wrap(mlp, "down_proj", index, [("down_proj", 0, hidden)], inter)
        elif isinstance(mlp, UngatedMLP):
            inter = mlp.intermediate_size  # this rank's features
            wrap(mlp, "fc1", index, [("up_proj", 0, inter)], hidden)
            wrap(mlp, "fc2", index, [("down_proj", 0, hidden)], inter)
        elif isinstance(mlp, SparseMoE):
            experts = mlp.adapters = LoRAExperts(max_loras, step, dtype, device, matmul)
            targets[index, "experts.gate_up_proj"] = (experts, 0)
            targets[index, "experts.down_proj"] = (experts, 1)
            if mlp.shared_expert is not None:  # a dense MLP (this rank's features) beside the experts
                shared = mlp.shared_expert.intermediate_size
                wrap(mlp.shared_expert, "gate_up_proj", index,
                     [("shared_expert.gate_proj", 0, shared), ("shared_expert.up_proj", shared, shared)], hidden)
                wrap(mlp.shared_expert, "down_proj", index, [("shared_expert.down_proj", 0, hidden)], shared)
    return targets


def checkpoint_names(model: object) -> CheckpointNames:
    """How ``model``'s family names its projections in checkpoints (and so in adapters)."""
    from kvloom.models.llama import LlamaForCausalLM
    assert isinstance(model, LlamaForCausalLM)
    return CheckpointNames(type(model).checkpoint_renames, model.fused_qkv_rows)


class LoRAManager:
    def __init__(self, model: object, config: ModelConfig, max_loras: int, max_rank: int,
                 matmul: str = "invariant", on_load: Callable[[int, LoRARequest], None] | None = None,
                 max_cpu_loras: int | None = None) -> None:
        """``model``: this rank's shard (the Llama model itself, not a tensor-parallel
        wrapper); ``matmul``: the model's matmul kernel (EngineConfig.matmul), the
        adapters' too; ``on_load``: told each adapter loaded and its slot (rank 0 under
        tensor parallel: the other ranks mirror it); ``max_cpu_loras``: adapters kept
        read (default ``max_loras``)."""
        self.config = config
        # Adapters as read from disk, by (name, binding), least recently used first: a
        # slot filled again with one of them reads nothing (vLLM's --max-cpu-loras).
        self._read: OrderedDict[tuple[str, int], LoRAAdapter] = OrderedDict()
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.on_load = on_load
        tp = getattr(model, "tp", None)
        self._rank, self._size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self._expert_parallel = tp is not None and tp.expert_parallel and tp.size > 1
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.step = LoRAStep()
        self._targets = wrap_llama_layers(model, config, max_loras, max_rank, self.step, matmul)
        self._checkpoint = checkpoint_names(model)
        self._layers = list({id(layer): layer for layer, _ in self._targets.values()}.values())
        # The native walk (if the model has one) and each layer's LoRA projections in its
        # table's order: the walk gets a new table after every load (_publish).
        # A layer_skip draft's walk over the first layers joins them (add_stack).
        stack = getattr(model, "native_stack", None)
        self._stacks: list[NativeDecoderStack] = [] if stack is None else [stack]
        self._names: list[str | None] = [None] * max_loras  # the adapter in each slot
        # Each bound name -> (its path, the binding's number): one name, one path, until it
        # is removed; a name bound again is a new adapter (its KV is not the old one's).
        self._bound: dict[str, tuple[str, int]] = {}
        self._bindings = itertools.count(1)
        self._refs = [0] * max_loras
        self._used = [0] * max_loras  # LRU clock of each slot's last acquire
        self._clock = itertools.count(1)
        self._slot_of: dict[str, int] = {}  # request id -> slot

    def bind(self, lora: LoRARequest) -> str:
        """Check ``lora``'s adapter against the model (loading it to do so if its name is
        not bound yet) and return its identity for the prefix cache and the scheduler's
        ``hold``: its name and the binding's number. LoRAError (a ValueError) naming what
        is wrong if it cannot be served; nothing is bound then."""
        self.add(lora)
        return f"{lora.lora_name}\0{self._bound[lora.lora_name][1]}"

    def hold(self, request: Request) -> bool:
        """Hold the slot of ``request``'s adapter (``request.lora_key``, from ``bind``),
        loading the adapter if it is in none: True if held (or the request needs none),
        False if every slot holds an adapter of other running requests. LoRAError if the
        adapter's name was unloaded or bound to another adapter since the request was
        queued."""
        if request.lora_key is None or request.request_id in self._slot_of:
            return True
        name, _, number = request.lora_key.partition("\0")
        binding = self._bound.get(name)
        if binding is None or str(binding[1]) != number:
            raise LoRAError(f"LoRA adapter {name!r} was unloaded while the request waited")
        if name in self._names:
            slot = self._names.index(name)
        else:
            idle = [slot for slot in range(self.max_loras) if self._refs[slot] == 0]
            if not idle:
                return False
            slot = min(idle, key=lambda s: (self._names[s] is not None, self._used[s]))  # empty, then LRU
            self._load(slot, LoRARequest(name, binding[1], binding[0]))
        self._refs[slot] += 1
        self._used[slot] = next(self._clock)
        self._slot_of[request.request_id] = slot
        return True

    def _binding(self, lora: LoRARequest) -> tuple[str, int] | None:
        """The name's binding, None if unbound; LoRAError if bound to another path."""
        binding = self._bound.get(lora.lora_name)
        if binding is not None and binding[0] != lora.lora_path:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} was loaded from {binding[0]}, not "
                            f"{lora.lora_path}: one name, one adapter")
        return binding

    def add(self, lora: LoRARequest) -> None:
        """Check ``lora``'s adapter against the model and bind its name to its path (vLLM's
        ``add_lora``); a slot is filled when a request first names it. LoRAError if the
        adapter could not be served or the name is bound to another path."""
        if self._binding(lora) is None:
            adapter = LoRAAdapter.load(lora.lora_name, lora.lora_path, self.config, self.max_rank,
                                       self._checkpoint)
            number = next(self._bindings)
            self._bound[lora.lora_name] = (lora.lora_path, number)
            self._keep_read((lora.lora_name, number), adapter)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """``lora``'s adapter, read from disk unless it is kept read (``lora_int_id``
        names the binding: rank 0's number, which other ranks are told)."""
        key = (lora.lora_name, lora.lora_int_id)
        adapter = self._read.get(key)
        if adapter is None:
            adapter = LoRAAdapter.load(lora.lora_name, lora.lora_path, self.config, self.max_rank,
                                       self._checkpoint)
        self._keep_read(key, adapter)
        return adapter

    def _keep_read(self, key: tuple[str, int], adapter: LoRAAdapter) -> None:
        self._read[key] = adapter
        self._read.move_to_end(key)
        while len(self._read) > self.max_cpu_loras:
            self._read.popitem(last=False)

    def remove(self, name: str) -> bool:
        """Unbind ``name`` (it may then name another adapter); its slot goes back to the
        free ones once the requests in flight on it are done. False if it was not bound."""
        if self._bound.pop(name, None) is None:
            return False
        for key in [key for key in self._read if key[0] == name]:
            del self._read[key]
        if name in self._names:
            self._names[self._names.index(name)] = None
        return True

    def _load(self, slot: int, lora: LoRARequest) -> None:
        self._fill(slot, lora.lora_name, self._adapter(lora))
        if self.on_load is not None:
            self.on_load(slot, lora)

    def mirror(self, slot: int, lora: LoRARequest) -> None:
        """Another rank's manager: load ``lora`` into ``slot``, as rank 0 did (its part of
        the adapter). Rank 0 holds the references; this rank only follows its loads."""
        self._fill(slot, lora.lora_name, self._adapter(lora))

    def _fill(self, slot: int, name: str, adapter: LoRAAdapter) -> None:
        for layer in self._layers:
            layer.clear(slot)
        for (layer_index, module), (a, b) in adapter.weights.items():
            layer, part = self._targets[layer_index, module]
            layer.load(slot, part, *self._rank_part(layer_index, module, a, b))
        for layer in self._layers:
            layer.finish(slot)
        self._names[slot] = name
        self._publish()

    def _rank_part(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a projection's A and B: the rows of B where the weight's
        output rows are cut (q/k/v, gate/up), the columns of A where its input is (o, down).
        The routed experts' likewise, as SparseMoE holds them: each expert's gate rows and
        up rows of this rank's features, and down's input columns of them."""
        if module.startswith("experts.") and self._expert_parallel:  # this rank's experts, whole
            assert self.config.moe is not None
            first, last = column_split(self.config.moe.num_experts, self._rank, self._size)
            return a[first:last], b[first:last]
        if module.startswith("experts."):
            moe = self.config.moe
            assert moe is not None
            full = moe.intermediate_size
            start, end = column_split(full, self._rank, self._size)
            if module == "experts.down_proj":
                return a[:, :, start:end], b
            return a, torch.cat((b[:, start:end], b[:, full + start:full + end]), dim=1)
        cut = llama_weight_slice(self.config, f"model.layers.{layer}.{TARGETS.get(module, 'mlp')}.{module}.weight",
                                 self._rank, self._size)
        if cut is None:
            return a, b
        if cut.dim == 0:
            return a, b[cut.start:cut.end]
        return a[:, cut.start:cut.end], b

    def _publish(self) -> None:
        """Hand the native walk the table of the slots as they are now (None, and so the
        module path for steps with adapter rows, where the slots' kernels are not its GEMM's)."""
        if not self._stacks:
            return
        # Each layer's four LoRA projections in the table's order (a part of each names it: up
        # is an un-gated MLP's fc1, gate_up's second part); None where the layer has none (an
        # expert layer's MLP).
        parts = ("q_proj", "o_proj", "up_proj", "down_proj")
        by_layer = [tuple(self._targets[index, name][0] if (index, name) in self._targets else None for name in parts)
                    for index in range(self.config.num_layers)]
        # The walk adds no delta on an expert layer's MLP (its routed experts, a shared expert):
        # while a slot holds one, adapter steps take the modules.
        expert_layers = [layer for (_, name), (layer, _) in self._targets.items()
                         if name.startswith(("experts.", "shared_expert."))]
        experts_adapted = any(any(kernels is not None for kernels in layer.kernels) if isinstance(layer, LoRALinear)
                              else any(part is not None for slot in layer.kernels for part in slot)
                              for layer in expert_layers)
        for stack in self._stacks:
            table = None if experts_adapted else stack_table(by_layer[:stack.shape.num_layers], self.max_loras,
                                                             stack.shape.isa)
            stack.set_lora(table)

    def add_stack(self, stack: NativeDecoderStack) -> None:
        """Another walk over the model's first layers (a layer_skip draft's, which shares
        them) gets the adapters' table too, its layers' rows of it."""
        self._stacks.append(stack)
        self._publish()

    def free(self, request: Request) -> None:
        """Let go of the request's slot (finished or preempted); nothing if it holds none."""
        slot = self._slot_of.pop(request.request_id, None)
        if slot is not None:
            self._refs[slot] -= 1

    def slots(self) -> Mapping[str, int]:
        """Request id -> slot, for the running requests that run an adapter."""
        return self._slot_of

    def adapters_of(self, requests: Iterable[Request]) -> tuple[str, ...]:
        """The names of the adapters ``requests`` run with (sorted; an adapter unloaded
        while its requests finish is left out)."""
        names = {r.adapter_name for r in requests}
        return tuple(sorted(name for name in names if name is not None and name in self._bound))

    def check_integrity(self, running_request_ids: set[str]) -> None:
        """Raise unless the holders of slots are running requests, as many as each slot's
        references."""
        counts = [0] * self.max_loras
        for request_id, slot in self._slot_of.items():
            counts[slot] += 1
            if request_id not in running_request_ids:
                raise LoRAError(f"request {request_id} holds LoRA slot {slot} but is not running")
        if counts != self._refs:
            raise LoRAError(f"LoRA slot references {self._refs} != the requests holding them {counts}")
