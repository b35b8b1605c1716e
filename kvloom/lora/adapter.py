"""Reading a PEFT LoRA adapter for a Llama-family model, checked against the model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, for each adapted
projection of each layer, ``lora_A`` [r, in] and ``lora_B`` [out, r]. The projection's
output becomes ``W x + scale * B (A x)``, ``scale = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). Every adapter feature this engine does not apply (DoRA, biases,
extra trained modules, per-module ranks, embedding or head adapters) is refused with
its name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloom.config import ModelConfig
from kvloom.models.weights import halves_from_pairs

# The projections an adapter may target, and the module that holds each.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config keys whose non-default values change the adapter's function: refused.
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None, "layer_replication": None}


class LoRAError(ValueError):
    """An adapter that cannot be served: missing, malformed, or not for this model."""


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a Llama projection, before fusing."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q, config.hidden_size), "k_proj": (kv, config.hidden_size),
            "v_proj": (kv, config.hidden_size), "o_proj": (config.hidden_size, q),
            "gate_proj": (config.intermediate_size, config.hidden_size),
            "up_proj": (config.intermediate_size, config.hidden_size),
            "down_proj": (config.hidden_size, config.intermediate_size)}[module]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer, projection) -> (A [rank, in], B [out, rank]), float32 as read
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, name: str, path: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
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
        rank, scale = cls._check_settings(where, settings, max_rank)
        from safetensors.torch import load_file
        try:
            tensors = load_file(str(weights_file))
        except Exception as error:  # noqa: BLE001 - a corrupt file is the adapter's problem
            raise LoRAError(f"{where}: adapter_model.safetensors cannot be read: {error}") from None
        return cls(name, path, rank, scale, cls._check_weights(where, tensors, config, rank))

    @staticmethod
    def _check_settings(where: str, settings: dict, max_rank: int) -> tuple[int, float]:
        if settings.get("peft_type", "LORA") != "LORA":
            raise LoRAError(f"{where}: peft_type {settings.get('peft_type')!r} is not LORA")
        for key, default in _REFUSED.items():
            if settings.get(key, default) not in (default, None, {}, False):
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
        targets = settings.get("target_modules")
        if isinstance(targets, str) or not targets or any(t not in TARGETS for t in targets):
            raise LoRAError(f"{where}: target_modules must be a list of {sorted(TARGETS)}, got {targets!r}")
        return rank, alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)

    @staticmethod
    def _check_weights(where: str, tensors: dict[str, torch.Tensor], config: ModelConfig,
                       rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None or TARGETS.get(match[3]) != match[2]:
                raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A or B of a Llama layer's "
                                f"{'/'.join(TARGETS)}")
            layer = int(match[1])
            if layer >= config.num_layers:
                raise LoRAError(f"{where}: tensor {key!r} is for layer {layer}; the model has {config.num_layers}")
            if match[2] == "mlp" and config.moe is not None and config.moe.is_sparse(layer):
                raise LoRAError(f"{where}: layer {layer}'s {match[3]} is in a mixture-of-experts FFN, whose experts "
                                "take no LoRA adapters here (an adapter on the attention projections serves)")
            halves.setdefault((layer, match[3]), {})[match[4]] = tensor
        weights = {}
        for (layer, module), pair in sorted(halves.items()):
            out_features, in_features = projection_shape(config, module)
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise LoRAError(f"{where}: layer {layer}'s {module} has lora_{'A' if a is None else 'B'} missing")
            if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
                raise LoRAError(f"{where}: layer {layer}'s {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                                f"the model needs A {(rank, in_features)} and B {(out_features, rank)}")
            if config.interleaved_rotary and module in ("q_proj", "k_proj"):  # ERNIE 4.5's: as the base's rows
                b = halves_from_pairs(b, out_features // config.head_dim)
            weights[layer, module] = (a.float(), b.float())
        if not weights:
            raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
        return weights
