"""Building blocks shared by the Llama family: RMSNorm, rotary embedding, gated MLP,
the (vocabulary-parallel) embedding.

Numerics follow Hugging Face transformers exactly (norms in float32, rotary tables in
float32 cast to the activation dtype) so that greedy outputs are token-identical. The
arithmetic itself is in kvloom/models/ops.py (fused C++ on CPU, PyTorch elsewhere).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvloom.batch import ForwardBatch
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.models import ops
from kvloom.models.sharding import column_split, vocab_split


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with ``residual``, first ``residual += x`` in place and norm that."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                             max_positions: int | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3, linear, YaRN or LongRoPE scaling
    applied (LongRoPE's factors by the context served, ``max_positions``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "longrope":
        # Phi-3's: each pair's wavelength stretched by its own factor, the long ones for a
        # context past the original (``max_positions``; RotaryEmbedding holds both sets where
        # a context may run past it and picks by token: ModelConfig.long_rope_from).
        long = max_positions is not None and max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope factors must hold head_dim / 2 = {inv_freq.shape[0]} values, "
                             f"got {factors.shape[0]}")
        return 1.0 / (factors * theta ** exponents)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, blended, scaled)
    if kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float,
                              scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn fewer
    than ``beta_slow`` times over the original context are interpolated (divided by
    ``factor``), those that turn more than ``beta_fast`` times kept, a linear ramp
    between (over the pair index, its ends rounded outwards unless ``truncate`` is
    false)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def pair_turning(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the frequency as it is (extrapolated), 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (1 for every other rope type): the
    given ``attention_factor``; else YaRN's 0.1 ln(factor) + 1, or with ``mscale`` and
    ``mscale_all_dim`` (DeepSeek) their ratio; LongRoPE's sqrt(1 + ln(factor) / ln(the
    original context)), the factor being the context over the original one."""
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if scaling and kind == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = float(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or float(scaling["max_position_embeddings"]) / original)
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not scaling or kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()





class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") rotary embedding over a precomputed cos/sin table.

    LongRoPE served past its original context holds two tables, the short factors' rows
    then the long ones' (``long_from``: ModelConfig.long_rope_from), and ``cos_sin_for``
    picks each token's row by its position and its request (ForwardBatch.long_rope)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        self.long_from: int | None = None
        sets = [max_positions]  # the context each table's factors are chosen for
        if kind == "longrope" and max_positions > int(scaling["original_max_position_embeddings"]):  # type: ignore[index]
            self.long_from = int(scaling["original_max_position_embeddings"])  # type: ignore[index]
            sets = [self.long_from, max_positions]  # the short factors' rows, then the long ones'
        angles = torch.cat([self._angles(head_dim, theta, scaling, served, positions) for served in sets])
        scale = rope_attention_factor(scaling)  # YaRN's, LongRoPE's; 1 otherwise
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)
        self.max_positions = max_positions

    @staticmethod
    def _angles(head_dim: int, theta: float, scaling: dict[str, Any] | None, served: int,
                positions: torch.Tensor) -> torch.Tensor:
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, served)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        return torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]

    def cos_sin_for(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of the batch's tokens; with two LongRoPE tables, a token's row in
        the long one where its position is past the original context or its request's
        prompt is (``batch.long_rope``). A request's flag only ever moves its prompt's
        tokens: its later ones lie past the original context anyway, so a decode graph
        captured without flags (runner/cuda_graphs.py) replays every decode right."""
        if self.long_from is None:
            return self.cos_sin(batch.positions)
        long = batch.positions >= self.long_from
        if batch.long_rope is not None:
            flags = torch.tensor(batch.long_rope, dtype=torch.bool, device=long.device)
            lengths = torch.tensor(batch.query_lens_list, device=long.device)
            long |= flags.repeat_interleave(lengths, output_size=batch.num_tokens)
        return self.cos_sin(batch.positions + long * self.max_positions)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotation tables, [tokens, head_dim] float32 each; looked up once
        per step and shared by every layer (all layers see the same positions). The
        tables follow the model's dtype (``model.to(bfloat16)`` rounds them, as HF's
        cast does); the lookup is widened back to float32 for ops.rotary_."""
        return self.cos[positions].float(), self.sin[positions].float()


class Float32ScaledRMSNorm(RMSNorm):
    """OLMo 2's: x / rms(x) * weight with the product in float32 before the cast
    (ops.rms_norm_scaled_in_float32; Llama's casts first)."""

    offset = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rms_norm_scaled_in_float32(x, self.weight, self.eps, residual, self.offset)


class GemmaRMSNorm(Float32ScaledRMSNorm):
    """Gemma's: x / rms(x) * (1 + weight); the checkpoint's weight is the offset from 1."""

    offset = 1.0


class SplitRMSNorm(nn.Module):
    """An RMSNorm whose rows tensor parallel splits between the ranks (OLMo 2's and OLMoE's
    q/k norms span every head; each rank holds its heads' columns, and its columns of the
    weight): each rank's sum of squares, all-reduced, gives the whole row's mean square, and
    each rank scales its own columns, in float32 as ``norm``'s kind does (Llama's rounds
    before the weight, OLMo 2's after). Not bit-identical to one process (the sum's order
    differs), as no all-reduced value is."""

    def __init__(self, norm: RMSNorm, full_width: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = norm.weight  # this rank's columns
        self.eps, self.full_width, self.tp = norm.eps, full_width, tp
        self.scaled_in_float32 = isinstance(norm, Float32ScaledRMSNorm)
        self.offset = getattr(norm, "offset", 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean_square = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.full_width
        normed = x32 * torch.rsqrt(mean_square + self.eps)
        if self.scaled_in_float32:
            return ((self.offset + self.weight.float()) * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def split_whole_norms(attention: nn.Module, config: Any, tp: TensorParallelGroup) -> None:
    """Under tensor parallel, ``attention``'s q/k norms over the whole projections (OLMo 2's,
    OLMoE's) as ``SplitRMSNorm``s; nothing in one process."""
    if tp.size > 1:
        attention.q_norm = SplitRMSNorm(attention.q_norm, config.num_heads * config.head_dim, tp)
        attention.k_norm = SplitRMSNorm(attention.k_norm, config.num_kv_heads * config.head_dim, tp)


# A gated MLP's activation of gate, times up: [rows, 2n] -> [rows, n].
GATED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; act is SiLU
    (SwiGLU), or GELU's tanh form for Gemma (GeGLU). Under tensor parallel each rank holds
    its share of the intermediate features (gate/up column-parallel, down row-parallel)
    and the down projection's partial sums are all-reduced; its bias (if any) is held by
    rank 0 alone, so it is added once."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 tp: TensorParallelGroup = SINGLE_PROCESS, activation: str = "silu") -> None:
        super().__init__()
        start, end = column_split(intermediate_size, tp.rank, tp.size)
        self.intermediate_size = end - start
        self.tp = tp
        self.activation = activation
        self._act = GATED_ACTIVATIONS[activation]
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self._act(self.gate_up_proj(x))))


class ResidualLayerNorm(RMSNorm):
    """LayerNorm with a bias, taking the Llama layers' residual add as RMSNorm does:
    ``norm(x, residual)`` adds x into the stream in place and norms the sum. ``bias`` False:
    a LayerNorm without one (Cohere's), its bias a buffer of zeros no checkpoint holds (so the
    fused kernel and the native walk compute it as any LayerNorm: + 0 changes no value)."""

    bias: torch.Tensor

    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__(hidden_size, eps)
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size))
        else:
            self.register_buffer("bias", torch.zeros(hidden_size), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual)


class UnweightedLayerNorm(nn.Module):
    """OLMo 1's LayerNorm: no weight, no bias, eps 1e-5, computed in float32 and cast back;
    ``norm(x, residual)`` adds x into the stream in place first, as RMSNorm does. ``eps`` is
    taken for the norms' common signature and not used: OLMo's is fixed (its config has none)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, 1e-5
        # ops.layer_norm's weight and bias (1 and 0: exact in every dtype), so that the fused
        # kernel (and the native walk, which reads them as a LayerNorm's) computes it; no
        # checkpoint holds them.
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)
        self.register_buffer("bias", torch.zeros(hidden_size), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """In float32, one rounding: (x - mean) / sqrt(var + eps) * 1 + 0 is that value."""
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual)


# config.json's names of the un-gated MLP's activation -> its form (ops.plain_activation).
PLAIN_FORMS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_erf", "relu": "relu",
               "relu2": "relu2"}


class UngatedMLP(nn.Module):
    """fc2(act(fc1(x))), the un-gated MLP of Phi, GPT-NeoX, GPT-2, StarCoder2 (GELU), OPT (ReLU),
    Nemotron and Arcee (ReLU squared), in the form ``hidden_act`` names (any other activation is refused, naming the
    model's architecture). Under tensor parallel as GatedMLP: each rank holds its share of the
    intermediate features (fc1 column-parallel, fc2 row-parallel, its bias rank 0's alone) and
    fc2's partial sums are all-reduced; the activation works element by element, so a rank's
    features need no other rank's."""

    def __init__(self, architecture: str, hidden_size: int, intermediate_size: int, bias: bool,
                 hidden_act: str, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        if hidden_act not in PLAIN_FORMS:
            raise ValueError(f"{architecture}: hidden_act {hidden_act!r} is not supported "
                             f"(supported: {', '.join(PLAIN_FORMS)})")
        self.form = PLAIN_FORMS[hidden_act]
        self.tp = tp
        start, end = column_split(intermediate_size, tp.rank, tp.size)
        self.intermediate_size = end - start
        self.fc1 = nn.Linear(hidden_size, self.intermediate_size, bias=bias)
        self.fc2 = nn.Linear(self.intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.fc2(ops.plain_activation(self.fc1(x), self.form)))


class VocabParallelEmbedding(nn.Module):
    """The token embedding; under tensor parallel each rank holds the rows of its share
    of the token ids (padded: ``weight`` has ``ceil(vocab / ranks)`` rows, the padding
    zero), looks up the ids it holds, zeroes the others, and the ranks' lookups are
    summed: exactly one rank contributes each row, so the sum is exact."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.end, rows = vocab_split(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))

    @property
    def num_real_rows(self) -> int:
        """Rows that hold token ids (the rest is padding)."""
        return self.end - self.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.num_real_rows)
        hidden = torch.nn.functional.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' logit columns [rows, padded shard] gathered into [rows,
        vocab] (padding cut); the other ranks get their own columns back."""
        if self.tp.size == 1:
            return local
        full = self.tp.gather_to_first(local)
        return full[..., :self.vocab_size] if self.tp.is_first else full
