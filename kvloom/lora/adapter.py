"""Reading a PEFT LoRA adapter for a model of the Llama-layer families, checked against the model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, for each adapted
projection of each layer, ``lora_A`` [r, in] and ``lora_B`` [out, r]. The projection's
output becomes ``W x + scale * B (A x)``, ``scale = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``); ``rank_pattern`` and ``alpha_pattern`` give a module its own
``r`` and ``lora_alpha`` (``Ranks``: matched on its name as PEFT matches them), and its
scale is folded into its B as it is read. Every adapter feature this engine does not
apply (DoRA, biases, extra trained modules, embedding or head adapters) is refused with
its name rather than silently dropped.

The tensors are named as the family's checkpoint names its modules (Phi's ``dense``,
GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``): the family's own renames
(``CheckpointNames``) take them to kvloom's modules, and a fused projection's adapter
(q/k/v in one, or gate/up) becomes one per part: the same A, each part's rows of B. PEFT
computes ``B (A x)`` over the fused output; each part's rows of it are ``B_part (A x)``, the
same sums, so the split changes no bit. A mixture-of-experts model's routed experts take
adapters on their fused tensors (PEFT's ``target_parameters``) or on each expert's own modules
(the hub's), both read into each expert's A and B of its fused gate/up and of its down.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvloom.config import ModelConfig
from kvloom.models.sharding import moe_block_name, moe_tensor
from kvloom.models.weights import halves_from_pairs, rename

# The unfused projections an adapter's parts are, and the module that holds each.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# kvloom's projection modules (after a family's renames) -> the parts their output holds, in order.
MODULE_PARTS = {**{name: (name,) for name in TARGETS}, "qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj"), "fc1": ("up_proj",), "fc2": ("down_proj",)}
# Mixture-of-experts layers' routed experts, as PEFT adapts them: ``target_parameters``
# naming the fused tensors (transformers' ``experts.gate_up_proj`` [E, 2 inter, hidden] and
# ``experts.down_proj`` [E, hidden, inter]). Each tensor's A is [rank * E, in] (expert e's
# rows e * rank ...) and its B [out, rank * E] (expert e's columns e, e + E, ...), so expert e's
# delta is scale * B_e A_e. Two tensors of one module nest: the first in the module's order
# (gate_up) wraps the module, the second wraps that, so its key lacks a ``.base_layer``.
EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # the experts module's order
# Or each expert as its own modules (transformers 4's, the hub's adapters for it): Mixtral's
# ``experts.N.w1`` / ``w3`` / ``w2`` (gate, up, down), the others' ``experts.N.gate_proj`` ...;
# gate's and up's adapters then become one for the fused gate_up, A [A_gate; A_up] and B
# block-diagonal, the same sums. A shared expert's projections (Qwen2-MoE's ``shared_expert``)
# are a dense MLP's to an adapter: ``shared_expert.gate_proj`` / ``up_proj`` / ``down_proj``.
EXPERT_MODULES = ("w1", "w2", "w3")  # Mixtral's names beside the Llama names TARGETS holds
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)$")
# Config keys whose non-default values change the adapter's function: refused. (PEFT sets
# fan_in_fan_out for GPT-2's Conv1D layers; it transposes the base weight when merging and
# leaves A and B as every adapter's, so it is not among them.)
_REFUSED = {"use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layer_replication": None}


@dataclass(frozen=True)
class Ranks:
    """Each adapted module's rank and scale, as PEFT gives them: ``r`` and ``lora_alpha``,
    unless a key of ``rank_pattern`` / ``alpha_pattern`` matches the module's name (its path
    in the base model: ``model.layers.3.self_attn.q_proj``; a routed experts' tensor's is
    ``model.layers.3.mlp.experts.gate_up_proj``) as PEFT's ``get_pattern_key`` matches it: the
    first key, in the file's order, that is the name's whole tail after a dot, as a regular
    expression. PEFT 0.22 writes such keys itself when it turns a transformers 4 adapter's
    gate and up modules into one on the fused experts' tensor (rank and alpha doubled)."""

    rank: int
    alpha: float
    rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def of(self, name: str) -> tuple[int, float]:
        """(rank, scale) of the module or experts' tensor called ``name``."""
        rank = next((r for key, r in self.rank_pattern.items() if re.match(rf"(.*\.)?({key})$", name)), self.rank)
        alpha = next((a for key, a in self.alpha_pattern.items() if re.match(rf"(.*\.)?({key})$", name)),
                     self.alpha)
        return rank, alpha / (math.sqrt(rank) if self.rslora else rank)



@dataclass(frozen=True)
class CheckpointNames:
    """How a family's checkpoints name its layers' projections, as its ``load_weights``
    reads them: ``renames`` ((theirs, ours) fragments, in order) take a checkpoint's
    module path to kvloom's, and ``qkv_rows`` puts a fused q/k/v projection's output rows in
    kvloom's [q | k | v] order (GPT-NeoX holds them head by head; None: already so)."""

    renames: tuple[tuple[str, str], ...] = ()
    qkv_rows: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    def module(self, path: str) -> str:
        """kvloom's name of the checkpoint's module ``path``."""
        return rename(path + ".", self.renames).removesuffix(".")  # the renames' fragments end in "."

    def targets(self) -> list[str]:
        """The names ``target_modules`` may give: kvloom's modules' and the family's own."""
        own = {theirs.strip(".").rsplit(".", 1)[-1] for theirs, ours in self.renames
               if ours.strip(".").rsplit(".", 1)[-1] in MODULE_PARTS}
        return sorted(own | set(MODULE_PARTS))


class LoRAError(ValueError):
    """An adapter that cannot be served: missing, malformed, or not for this model."""


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a Llama projection, before fusing (or of a shared
    expert's, ``shared_expert.gate_proj`` ...)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if module.startswith("shared_expert."):
        assert config.moe is not None
        shared, hidden = config.moe.shared_expert_intermediate_size, config.hidden_size
        return (hidden, shared) if module.endswith("down_proj") else (shared, hidden)
    return {"q_proj": (q, config.hidden_size), "k_proj": (kv, config.hidden_size),
            "v_proj": (kv, config.hidden_size), "o_proj": (config.hidden_size, q),
            "gate_proj": (config.intermediate_size, config.hidden_size),
            "up_proj": (config.intermediate_size, config.hidden_size),
            "down_proj": (config.hidden_size, config.intermediate_size)}[module]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    ranks: Ranks
    # (layer, projection) -> (A [rank, in], scale * B [out, rank]), float32: each module's
    # own scale (Ranks.of) folded in, as the layers would fold one (the same float32 product)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, name: str, path: str, config: ModelConfig, max_rank: int,
             names: CheckpointNames = CheckpointNames()) -> LoRAAdapter:
        """The adapter at ``path`` for a model of ``config`` whose checkpoints name its
        projections as ``names`` says; LoRAError naming what cannot be served."""
        directory = Path(path).expanduser()
        where = f"LoRA adapter {name!r} ({path})"
        config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
        if not config_file.is_file():
            raise LoRAError(f"{where}: no adapter_config.json (a PEFT adapter directory holds it and "
                            "adapter_model.safetensors)")
        if not weights_file.is_file():
            raise LoRAError(f"{where}: no adapter_model.safetensors (save the adapter with safetensors)")
        try:
            settings = json.loads(config_file.read_text())
        except (OSError, ValueError) as error:
            raise LoRAError(f"{where}: adapter_config.json is not JSON: {error}") from None
        targets = names.targets() + (list(EXPERT_MODULES) if config.moe is not None else [])
        ranks, parameters = cls._check_settings(where, settings, max_rank, targets)
        from safetensors.torch import load_file
        try:
            tensors = load_file(str(weights_file))
        except Exception as error:  # noqa: BLE001 - a corrupt file is the adapter's problem
            raise LoRAError(f"{where}: adapter_model.safetensors cannot be read: {error}") from None
        weights = cls._check_weights(_Reading(where, ranks, max_rank), tensors, config, names, parameters)
        return cls(name, path, ranks, weights)

    @staticmethod
    def _check_settings(where: str, settings: dict, max_rank: int, targets: list[str]
                        ) -> tuple[Ranks, list[str]]:
        """(ranks, target_parameters) of a valid adapter config; LoRAError naming what is not."""
        if settings.get("peft_type", "LORA") != "LORA":
            raise LoRAError(f"{where}: peft_type {settings.get('peft_type')!r} is not LORA")
        for key, default in _REFUSED.items():
            if settings.get(key, default) not in (default, None, {}, [], False):
                raise LoRAError(f"{where}: {key}={settings[key]!r} is not supported")
        if settings.get("bias", "none") != "none":
            raise LoRAError(f"{where}: bias={settings['bias']!r} is not supported (only 'none')")
        rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise LoRAError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        parameters = settings.get("target_parameters") or []
        if isinstance(parameters, str) or any(_expert_tensor(p) is None for p in parameters):
            raise LoRAError(f"{where}: target_parameters must name mixture-of-experts tensors "
                            f"(experts.gate_up_proj, experts.down_proj), got {parameters!r}")
        named = settings.get("target_modules") or ([] if parameters else None)
        if isinstance(named, str) or named is None or any(t not in targets for t in named):
            raise LoRAError(f"{where}: target_modules must be a list of {targets}, got {named!r}")
        patterns = []
        for key, kind in (("rank_pattern", "a positive integer"), ("alpha_pattern", "a number")):
            pattern = settings.get(key) or {}
            if not isinstance(pattern, dict) or not all(_pattern_value(value, key) for value in pattern.values()):
                raise LoRAError(f"{where}: {key} must map module names to {kind} each, got {pattern!r}")
            for expression in pattern:
                try:
                    re.compile(expression)
                except re.error as error:
                    raise LoRAError(f"{where}: {key} key {expression!r} is not a regular expression: {error}") from None
            patterns.append(pattern)
        ranks = Ranks(rank, alpha, bool(settings.get("use_rslora")), *patterns)
        return ranks, parameters

    @staticmethod
    def _check_weights(reading: _Reading, tensors: dict[str, torch.Tensor], config: ModelConfig,
                       names: CheckpointNames, parameters: list[str]
                       ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        where = reading.where
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        # (layer, module) -> (its name in messages, PEFT's name of it, for its rank and scale)
        theirs: dict[tuple[int, str], tuple[str, str]] = {}
        nested: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (layer, wrappers inside): experts' A, B
        per_expert: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}  # (layer, part, expert): A, B
        expert_names: dict[tuple[int, str, int], str] = {}  # PEFT's name of each expert's module
        for key, tensor in tensors.items():
            key_match = _KEY.match(key)
            path = names.module(key_match[1]) if key_match is not None else ""
            experts = _EXPERTS.match(path)
            if key_match is not None and experts is not None:  # PEFT's on the fused expert tensors
                depth = len(experts[2]) // len(".base_layer")
                nested.setdefault((int(experts[1]), depth), {})[key_match[2]] = tensor
                continue
            part = _moe_part(path, config) if key_match is not None else None
            if key_match is not None and part is not None:
                layer, module, expert = part
                if expert is not None:  # one expert's own module (the hub's)
                    per_expert.setdefault((layer, module, expert), {})[key_match[2]] = tensor
                    expert_names[layer, module, expert] = key_match[1]
                else:  # a shared expert's projection: a dense MLP's to the rest
                    halves.setdefault((layer, module), {})[key_match[2]] = tensor
                    theirs[layer, module] = (module, key_match[1])
                continue
            match = _MODULE.match(path) if key_match is not None else None
            if (key_match is None or match is None or match[3] not in MODULE_PARTS
                    or TARGETS[MODULE_PARTS[match[3]][0]] != match[2]):
                raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A or B of a decoder layer's projection "
                                f"({', '.join(names.targets())})")
            layer, module = int(match[1]), match[3]
            if layer >= config.num_layers:
                raise LoRAError(f"{where}: tensor {key!r} is for layer {layer}; the model has {config.num_layers}")
            if match[2] == "mlp" and config.moe is not None and config.moe.is_sparse(layer):
                raise LoRAError(f"{where}: layer {layer}'s {module} is in a mixture-of-experts FFN, whose experts "
                                "take adapters on their tensors (PEFT's target_parameters: experts.gate_up_proj, "
                                "experts.down_proj)")
            halves.setdefault((layer, module), {})[key_match[2]] = tensor
            theirs[layer, module] = (key_match[1].rsplit(".", 1)[-1], key_match[1])
        weights = _expert_weights(reading, nested, config, parameters)
        for (layer, module), pair in _modules_per_expert(reading, per_expert, expert_names, config).items():
            if (layer, module) in weights:
                raise LoRAError(f"{where}: layer {layer}'s {module} is adapted twice (as one tensor and expert by "
                                "expert)")
            weights[layer, module] = pair
        for (layer, module), pair in sorted(halves.items()):
            parts, (label, peft_name) = MODULE_PARTS.get(module, (module,)), theirs[layer, module]
            outs = [projection_shape(config, part)[0] for part in parts]
            in_features = projection_shape(config, parts[0])[1]
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise LoRAError(f"{where}: layer {layer}'s {label} has lora_{'A' if a is None else 'B'} missing")
            rank, scale = reading.rank_and_scale(peft_name)
            if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (sum(outs), rank):
                raise LoRAError(f"{where}: layer {layer}'s {label} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                                f"the model needs A {(rank, in_features)} and B {(sum(outs), rank)}")
            if module == "qkv_proj" and names.qkv_rows is not None:
                b = names.qkv_rows(b)
            for part, rows in zip(parts, b.split(outs), strict=True):
                if (layer, part) in weights:
                    raise LoRAError(f"{where}: layer {layer}'s {part} is adapted twice (by {label} and another)")
                if config.interleaved_rotary and part in ("q_proj", "k_proj"):  # ERNIE 4.5's: as the base's rows
                    rows = halves_from_pairs(rows, rows.shape[0] // config.head_dim, config.rotary_dim)
                weights[layer, part] = (a.float(), rows.float() * scale)
        if not weights:
            raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
        return weights


@dataclass(frozen=True)
class _Reading:
    """One adapter being read: where it is (for messages), its ranks, and the largest rank
    the engine's slots hold."""

    where: str
    ranks: Ranks
    max_rank: int

    def rank_and_scale(self, name: str) -> tuple[int, float]:
        """(rank, scale) of PEFT's module or experts' tensor ``name``; LoRAError past max_lora_rank."""
        rank, scale = self.ranks.of(name)
        if rank > self.max_rank:
            raise LoRAError(f"{self.where}: {name} has rank {rank} (rank_pattern), above max_lora_rank "
                            f"{self.max_rank}")
        return rank, scale


def _pattern_value(value: object, key: str) -> bool:
    """Whether ``value`` is a rank (``rank_pattern``'s: a positive integer) or an alpha (a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) and value >= 1 if key == "rank_pattern" else True


def _moe_part(path: str, config: ModelConfig) -> tuple[int, str, int | None] | None:
    """What a module ``path`` (kvloom's names) is in a mixture-of-experts block: (layer,
    ``gate`` / ``up`` / ``down``, its expert) for one expert's projection, (layer,
    ``shared_expert.gate_proj`` ..., None) for the shared expert's; None for anything else."""
    block = moe_block_name(path.removeprefix("model.") + ".weight") if config.moe is not None else None
    inside = moe_tensor(block[1]) if block is not None else None
    if block is None or inside is None:
        return None
    if inside.expert is not None and inside.part in ("gate", "up", "down"):
        return block[0], inside.part, inside.expert
    if inside.part in ("shared_gate_proj", "shared_up_proj", "shared_down_proj"):
        return block[0], "shared_expert." + inside.part.removeprefix("shared_"), None
    return None


def _expert_tensor(entry: object) -> str | None:
    """The experts' tensor (``gate_up_proj`` or ``down_proj``) a ``target_parameters``
    entry names, or None if it names another tensor (a router's, say). A bare tensor name
    (PEFT 0.22 writes them, converting gate/up/down modules to the fused tensors) names the
    experts' too: a projection module's own parameter is its ``weight``, never so called."""
    parts = entry.rsplit(".", 2) if isinstance(entry, str) else []
    if not parts or parts[-1] not in EXPERT_TENSORS:
        return None
    return parts[-1] if len(parts) == 1 or parts[-2] == "experts" else None


def _expert_weights(reading: _Reading, nested: dict[tuple[int, int], dict[str, torch.Tensor]], config: ModelConfig,
                    parameters: list[str]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The routed experts' adapters: (layer, ``experts.<tensor>``) -> (A [E, rank, in], scale
    * B [E, out, rank]), float32, from PEFT's tensors keyed by (layer, how many wrappers lie
    inside theirs). Which tensor a depth holds follows from ``target_parameters`` (matched
    as PEFT matches them: the tensor's path, or a suffix of it after a dot)."""
    where = reading.where
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, depth), pair in sorted(nested.items()):
        moe = config.moe
        if layer >= config.num_layers or moe is None or not moe.is_sparse(layer):
            raise LoRAError(f"{where}: layer {layer} has no mixture-of-experts FFN, yet the adapter adapts its experts")
        paths = {tensor: f"model.layers.{layer}.mlp.experts.{tensor}" for tensor in EXPERT_TENSORS}
        targeted = [tensor for tensor, path in paths.items()
                    if any(path == entry or path.endswith("." + entry) for entry in parameters)]
        if depth >= len(targeted):
            raise LoRAError(f"{where}: layer {layer}'s experts have LoRA tensors that target_parameters "
                            f"({parameters!r}) does not name")
        tensor = targeted[len(targeted) - 1 - depth]
        experts, hidden, inter = moe.num_experts, config.hidden_size, moe.intermediate_size
        out, in_features = (2 * inter, hidden) if tensor == "gate_up_proj" else (hidden, inter)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoRAError(f"{where}: layer {layer}'s experts.{tensor} has lora_{'A' if a is None else 'B'} missing")
        rank, scale = reading.rank_and_scale(paths[tensor])
        if tuple(a.shape) != (rank * experts, in_features) or tuple(b.shape) != (out, rank * experts):
            raise LoRAError(f"{where}: layer {layer}'s experts.{tensor} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the model's {experts} experts need A {(rank * experts, in_features)} "
                            f"and B {(out, rank * experts)}")
        if moe.gpt_oss_layout and tensor == "gate_up_proj":  # its gate and up outputs alternate: as gate | up
            b = torch.cat((b[0::2], b[1::2]))
        weights[layer, f"experts.{tensor}"] = (
            a.float().reshape(experts, rank, in_features),
            (b.float() * scale).reshape(out, rank, experts).permute(2, 0, 1).contiguous())
    return weights


def _modules_per_expert(reading: _Reading, per_expert: dict[tuple[int, str, int], dict[str, torch.Tensor]],
                        peft_names: dict[tuple[int, str, int], str], config: ModelConfig
                        ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Adapters on each expert's own modules as the fused tensors' (``_expert_weights``):
    gate's and up's stacked into one for gate_up (A [A_gate; A_up], scale * B block-diagonal;
    each part as wide as its largest rank over the experts, an expert's smaller rank, an
    expert or a part the adapter leaves alone, zeros: they add exact zeros)."""
    where, moe = reading.where, config.moe
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    if moe is None or not per_expert:
        return out
    experts, hidden, inter = moe.num_experts, config.hidden_size, moe.intermediate_size
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    scaled: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (A, scale * B), float32
    for (layer, part, expert), pair in per_expert.items():
        if not moe.is_sparse(layer) or expert >= experts:
            raise LoRAError(f"{where}: the adapter adapts layer {layer}'s expert {expert}; the model has "
                            f"{experts if moe.is_sparse(layer) else 'no'} experts there")
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoRAError(f"{where}: layer {layer}'s expert {expert} {part} has lora_{'A' if a is None else 'B'} "
                            "missing")
        rank, scale = reading.rank_and_scale(peft_names[layer, part, expert])
        rows, columns = shapes[part]
        if tuple(a.shape) != (rank, columns) or tuple(b.shape) != (rows, rank):
            raise LoRAError(f"{where}: layer {layer}'s expert {expert} {part} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the model needs A {(rank, columns)} and B {(rows, rank)}")
        scaled[layer, part, expert] = (a.float(), b.float() * scale)
    for layer in sorted({layer for layer, _, _ in per_expert}):
        for tensor, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            widths = {part: max((scaled[layer, part, e][0].shape[0] for e in range(experts)
                                 if (layer, part, e) in scaled), default=0) for part in parts}
            if not any(widths.values()):
                continue
            out_rows, in_features = (2 * inter, hidden) if tensor == "gate_up_proj" else (hidden, inter)
            a = torch.zeros(experts, sum(widths.values()), in_features)
            b = torch.zeros(experts, out_rows, sum(widths.values()))
            first_column = 0
            for part in parts:
                first_row = inter if part == "up" else 0
                for expert in range(experts):
                    if (layer, part, expert) in scaled:
                        a_e, b_e = scaled[layer, part, expert]
                        rank = a_e.shape[0]
                        a[expert, first_column:first_column + rank] = a_e
                        b[expert, first_row:first_row + b_e.shape[0], first_column:first_column + rank] = b_e
                first_column += widths[part]
            out[layer, f"experts.{tensor}"] = (a, b)
    return out
