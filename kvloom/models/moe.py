"""The sparse mixture-of-experts FFN (Mixtral, Qwen2-MoE, DeepSeek-V2/V3, GPT-OSS).

``SparseMoE(hidden_size, moe, tp)`` maps ``[tokens, hidden] -> [tokens, hidden]``:
the router (``MoERouter``, the family's rule in ``route``) picks ``moe.top_k`` experts
per token with a weight each; every expert is a gated MLP held in two 3D tensors,
``experts_gate_up`` ``[experts, 2 * inter, hidden]`` (gate | up) and ``experts_down``
``[experts, hidden, inter]``; a shared expert (Qwen2-MoE, DeepSeek) runs for every
token. GPT-OSS's experts add a bias after each matmul and use a clamped SwiGLU
(``swigluoai``). ``experts_grouped`` is the fast path: the (token, expert) pairs sorted by
expert, every expert's gate/up and down matmuls over its contiguous slice (packed for kvloom's
GEMM: all experts in two ``gemm_grouped_bf16`` calls), the weighted rows added back token by
token (``cpu_ops.moe_combine``); ``experts_reference`` is the plain per-token loop it is
tested against. Packed bf16 routers whose rule ``routes_natively`` names route by
``cpu_ops.moe_route``, the native decoder walk's kernel (models/decoder_stack.py runs these
layers too).

Numerics follow transformers 5.24 (its ``*TopkRouter`` / ``*Experts`` modules): each
token's expert outputs are added in ascending expert order onto zeros (so its result
depends only on its own row and experts), in the activation dtype; the routing weights
are float32 except Qwen2-MoE's. Under tensor parallel each rank holds its share of
every expert's intermediate features (and the shared expert's): the rank's partial sums
of the routed and shared outputs are added and all-reduced once; the router is
replicated, so every rank routes alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.kernels import cpu_ops, gemm
from kvloom.model_families import MoEConfig
from kvloom.models import ops
from kvloom.models.layers import PLAIN_FORMS, GatedMLP, UngatedMLP
from kvloom.models.mxfp4_experts import MXFP4Experts
from kvloom.models.packed_linear import InvariantLinear, can_pack_invariant, packed_linear, packed_linears
from kvloom.models.sharding import MoETensor, TensorSlice, column_split, moe_tensor, moe_weight_slice


# ---- routing -------------------------------------------------------------------------
def route(logits: torch.Tensor, moe: MoEConfig,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[tokens, experts]`` -> (weights, experts), ``[tokens, top_k]``
    each: the weights float32, the expert ids int64, in no particular order."""
    if moe.scoring == "topk_softmax":  # GPT-OSS: pick by logit, then softmax the picks in their dtype
        values, experts = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype).float(), experts
    if moe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = logits.float().sigmoid()
    # Mixtral and Qwen2-MoE take the top-k sorted, DeepSeek unsorted: the same experts,
    # but the order decides how the renormalising sum rounds.
    ordered = not moe.router_float32
    if moe.topk_method == "greedy":
        weights, experts = torch.topk(scores, moe.top_k, dim=-1, sorted=ordered)
    elif moe.topk_method == "group_limited_greedy":  # groups ranked by their best expert
        group_scores = scores.view(-1, moe.num_groups, moe.num_experts // moe.num_groups).max(dim=-1).values
        allowed = _chosen_groups(group_scores, moe)
        weights, experts = torch.topk(scores.masked_fill(~allowed, 0.0), moe.top_k, dim=-1, sorted=False)
    else:  # noaux_tc: the bias steers the choice; the weights are the raw scores
        if correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs the router's e_score_correction_bias")
        choice = scores + correction_bias
        group_scores = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups).topk(2, dim=-1)[0].sum(-1)
        allowed = _chosen_groups(group_scores, moe)
        experts = torch.topk(choice.masked_fill(~allowed, float("-inf")), moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        denominator = weights.sum(dim=-1, keepdim=True)
        if moe.scoring == "sigmoid":  # DeepSeek-V3's and LFM2-MoE's guard (a softmax's top-k never sums to 0)
            denominator = denominator + moe.norm_topk_eps
        weights = weights / denominator
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, experts


def _chosen_groups(group_scores: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[tokens, groups] -> [tokens, experts] bool: the experts of each token's
    ``topk_groups`` best groups."""
    chosen = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.repeat_interleave(moe.num_experts // moe.num_groups, dim=1)


def routes_natively(moe: MoEConfig) -> bool:
    """Whether ``moe``'s rule is one of kvloom::moe_route's: a softmax's greedy top-k
    (Mixtral's, Qwen's, OLMoE's, GraniteMoe's, DeepSeek-V2-Lite's), or sigmoid scores' top-k,
    steered by a selection bias in one group or not (LFM2-MoE's, DeepSeek-V3's with one group),
    renormalised or not, scaled. Packed bf16 routers, and float32 routers (DeepSeek's) in a
    bf16 model, run the kernel on a CPU, as the native walk does."""
    if moe.router_bias or moe.num_experts > cpu_ops.MAX_ROUTED_EXPERTS:
        return False
    greedy = moe.topk_method == "greedy" and not moe.score_correction_bias
    if moe.topk_method == "group_limited_greedy":  # DeepSeek-V2's: a softmax's choice within the best groups
        return moe.scoring == "softmax" and not moe.score_correction_bias and _groups_hold_top_k(moe)
    corrected = moe.topk_method == "noaux_tc" and moe.score_correction_bias and _groups_hold_top_k(moe)
    return greedy if moe.scoring == "softmax" else moe.scoring == "sigmoid" and (greedy or corrected)


def _groups_hold_top_k(moe: MoEConfig) -> bool:
    return moe.topk_groups * (moe.num_experts // moe.num_groups) >= moe.top_k


def native_groups(moe: MoEConfig) -> tuple[int, int, str] | None:
    """kvloom::moe_route's group arguments for ``moe``'s choice (None: not group-limited)."""
    if moe.num_groups == 1 or moe.topk_method == "greedy":
        return None
    return moe.num_groups, moe.topk_groups, "best" if moe.topk_method == "group_limited_greedy" else "top2_sum"


class MoERouter(nn.Module):
    """The router's weight ``[experts, hidden]`` (and DeepSeek-V3's and LFM2-MoE's per-expert
    ``score_correction_bias``, always float32, GPT-OSS's logit ``bias``). With
    ``moe.router_float32`` (DeepSeek) the weight stays float32 too through ``model.to(dtype)``
    and the logits are computed in float32, as
    transformers keeps ``gate.weight`` and the bias in float32; otherwise the router
    runs in the activation dtype."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        kept = torch.float32 if moe.router_float32 else None  # whatever the model's default dtype
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size, dtype=kept))
        # The selection bias is float32 whatever the router's dtype (transformers keeps it so).
        self.score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32))
                                      if moe.score_correction_bias else None)
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.router_bias else None
        self.packed: nn.Module | None = None  # the weight as the matmul kernel's (pack)
        # Set by pack(): the top-k by kvloom::moe_route (a bf16 router on kvloom's GEMM whose
        # rule it is: routes_natively), as the native walk routes; else route()'s torch ops.
        self.native_route = False
        # Set by pack() for a float32 router on a CPU with kvloom's kernels (--matmul invariant):
        # a bf16 model's logits by kvloom::router_logits (float32, a row's bits its own), then
        # kvloom::moe_route where it routes natively, as the native walk computes them.
        self.native_logits = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, hidden] -> (weights, experts), [tokens, top_k] each."""
        if self.native_logits and x.dtype is torch.bfloat16 and x.is_cpu:
            return self._route(cpu_ops.router_logits(x.contiguous(), self.weight), self.native_route)
        if self.moe.router_float32:  # a float32 model, or not on kvloom's kernels: transformers' matmul
            x = x.float()  # the weight stays float32 (_apply)
            logits = self.packed(x) if self.packed is not None else F.linear(x, self.weight, self.bias)
            return self._route(logits, False)
        logits = self.packed(x) if self.packed is not None else F.linear(x, self.weight, self.bias)  # [tokens, experts]
        return self._route(logits, self.native_route)

    def _route(self, logits: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if native:
            moe, sigmoid = self.moe, self.moe.scoring == "sigmoid"
            return cpu_ops.moe_route(logits, moe.top_k, moe.norm_topk_prob, moe.routed_scaling_factor,
                                     sigmoid=sigmoid, bias=self.score_correction_bias,
                                     eps=moe.norm_topk_eps if sigmoid else 0.0,  # route()'s guard: sigmoid's only
                                     groups=native_groups(moe))
        return route(logits, self.moe, self.score_correction_bias)

    def pack(self, matmul: str) -> int:
        """The weight as ``matmul``'s layer where it applies (a float32 router's too: for
        ``invariant`` its rows padded as every float32 matmul's on CPU, and for a bf16 model's
        steps kvloom::router_logits)."""
        self.packed = packed_linear(self.weight, self.bias, matmul)
        self.native_logits = (self.moe.router_float32 and matmul == "invariant" and self.bias is None
                              and self.weight.device.type == "cpu" and cpu_ops.available())
        self.native_route = ((isinstance(self.packed, InvariantLinear) or self.native_logits)
                             and routes_natively(self.moe) and cpu_ops.available())
        return int(self.packed is not None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoERouter:
        convert = fn
        if self.moe.router_float32:
            def convert(tensor: torch.Tensor) -> torch.Tensor:  # to where fn sends it, kept float32
                return tensor.to(device=fn(tensor.new_empty(0)).device, dtype=torch.float32)

        super()._apply(convert, recurse)  # type: ignore[no-untyped-call]
        bias = self.score_correction_bias
        if bias is not None and bias.dtype != torch.float32:  # kept float32 through a dtype change
            bias.data = bias.data.float()
        return self


# ---- the experts ---------------------------------------------------------------------
# Each expert's (gate_up, down) as the matmul kernel's layers (SparseMoE.pack).
PackedExperts = Sequence[tuple[nn.Module, nn.Module]]


class ExpertAdapters(Protocol):
    """LoRA deltas on the experts' two matmuls (kvloom/lora/layers.py's ``LoRAExperts``;
    this layer only calls it): ``row_slots`` gives each of a forward's ``rows`` rows its
    adapter slot (-1: the base model), or one slot for every row, or None when no row runs
    one; ``add`` adds slot ``slots[i]``'s (or ``slots``') delta for ``expert``'s ``part``
    ("gate_up" or "down") to ``y[i]``, whose input row is ``x[i]``."""

    def row_slots(self, rows: int) -> torch.Tensor | int | None: ...

    def add(self, part: str, expert: int, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | int) -> None: ...


def swigluoai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation on [rows, 2 * inter] (gate | up): gate clamped above at
    ``limit``, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), op by
    op in the input's dtype as transformers' GptOssExperts computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(moe: MoEConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """[rows, 2 * inter] (gate | up) -> [rows, inter]: the experts' activation; for experts
    without a gate [rows, inter] -> [rows, inter] (Nemotron 3's squared ReLU, the un-gated
    MLP's own, ``ops.plain_activation``)."""
    if not moe.gated:
        form = PLAIN_FORMS[moe.hidden_act]
        return lambda up: ops.plain_activation(up, form)
    if moe.hidden_act == "swigluoai":
        alpha, limit = moe.swiglu_alpha, moe.swiglu_limit
        return lambda gate_up: swigluoai(gate_up, alpha, limit)
    return ops.silu_and_mul


# Every expert's biases, (gate_up [E, 2 * inter], down [E, hidden]) (GPT-OSS's).
ExpertBiases = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GroupedExperts:
    """Every expert's two matmuls packed for the grouped GEMM (kernels/gemm.py's
    ``pack_weight_groups``): ``gate_up`` [experts, packed elements of a
    [gate_up_features, hidden] weight], ``down`` [experts, those of a [hidden_size,
    inter] one], row e expert e's, run on path ``isa``."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_features: int
    hidden_size: int
    isa: str


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None,
                    weights: torch.Tensor, experts: torch.Tensor,
                    packed: PackedExperts | None = None, adapters: ExpertAdapters | None = None,
                    biases: ExpertBiases | None = None,
                    activation: Callable[[torch.Tensor], torch.Tensor] = ops.silu_and_mul,
                    grouped: GroupedExperts | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for every token t: x [tokens,
    hidden], gate_up [E, 2 * inter, hidden], down [E, hidden, inter] (or ``packed``: each
    expert's two layers; or ``grouped``: all of them for the grouped GEMM), weights and
    experts [tokens, top_k]. Pairs sorted by expert: each expert's gate/up matmul over its
    rows (with ``grouped`` every expert's in one native call), the activation and the
    routing weights over every pair at once (a row's result is its own), each expert's
    down matmul, and the weighted outputs added up token by token, each token's experts in
    ascending order, one rounded add each, as transformers adds them (one native call on
    a CPU, else one ``index_add_`` per expert).
    With ``adapters``, each pair's rows get their token's adapter delta after each matmul
    (its gate/up output before the activation, its down output before the routing weight;
    expert by expert, whatever ``grouped`` says).
    With ``biases``, each matmul's rounded output then gets its expert's bias added (as
    transformers' GptOssExperts adds it); ``activation`` maps gate | up to the down input."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)  # [pairs]: pair p is token p // top_k's choice p % top_k
    pair = torch.arange(flat.numel(), device=flat.device)
    # Within an expert, rows in transformers' order (by choice slot, then token): a float32
    # matmul's rows can round differently by their place in the call.
    order = torch.argsort((flat * top_k + pair % top_k) * num_tokens + pair // top_k)
    num_experts = (grouped.gate_up.shape[0] if grouped is not None else len(packed) if packed is not None
                   else gate_up.shape[0])  # type: ignore[union-attr]
    # The slices' bounds (one sync); ids past the last expert (another rank's, under expert
    # parallel) sort after every slice and are left out.
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    total = sum(counts)
    if total == 0:
        return torch.zeros_like(x)
    order = order[:total]
    tokens = order // top_k  # [pairs], grouped by expert
    rows = x.index_select(0, tokens)  # [pairs, hidden]
    pair_weights = weights.reshape(-1)[order]  # [pairs]
    row_slots = adapters.row_slots(num_tokens) if adapters is not None else None
    pair_slots = row_slots.index_select(0, tokens) if isinstance(row_slots, torch.Tensor) else row_slots  # [pairs]
    pair_experts = flat[order] if biases is not None else None  # [pairs]
    if grouped is not None and pair_slots is None:
        starts = torch.tensor([0, *itertools.accumulate(counts)])
        projected = gemm.gemm_grouped_bf16(rows, grouped.gate_up, starts, grouped.gate_up_features, grouped.isa)
        if biases is not None:
            projected = projected + biases[0].index_select(0, pair_experts)  # type: ignore[arg-type]
        output = gemm.gemm_grouped_bf16(activation(projected), grouped.down, starts, grouped.hidden_size,
                                        grouped.isa)
        if biases is not None:
            output = output + biases[1].index_select(0, pair_experts)  # type: ignore[arg-type]
    else:
        output = _experts_one_by_one(rows, counts, gate_up, down, packed, adapters, pair_slots, biases, activation)
    return _combine_pairs(x, output, pair_weights, experts, order, counts, tokens)


def _experts_one_by_one(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor | None,
                        down: torch.Tensor | None, packed: PackedExperts | None, adapters: ExpertAdapters | None,
                        pair_slots: torch.Tensor | int | None, biases: ExpertBiases | None,
                        activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """experts_grouped's matmuls a call per expert chosen: [pairs, hidden] -> [pairs, hidden]."""
    spans, start = [], 0  # (expert, first pair, past its last) of every expert chosen
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
        start += count

    def matmul(part: int, expert: int, rows: torch.Tensor) -> torch.Tensor:  # 0: gate/up, 1: down
        y = (packed[expert][part](rows) if packed is not None
             else F.linear(rows, (gate_up if part == 0 else down)[expert]))  # type: ignore[index]
        return y if biases is None else y + biases[part][expert]

    def adapt(part: str, expert: int, rows: torch.Tensor, y: torch.Tensor, start: int, end: int) -> None:
        if adapters is not None and pair_slots is not None:
            adapters.add(part, expert, rows, y, pair_slots[start:end] if isinstance(pair_slots, torch.Tensor)
                         else pair_slots)

    projected = []
    for expert, start, end in spans:
        projected.append(matmul(0, expert, rows[start:end]))
        adapt("gate_up", expert, rows[start:end], projected[-1], start, end)
    activated = activation(torch.cat(projected))  # [pairs, inter]
    outputs = []
    for expert, start, end in spans:
        outputs.append(matmul(1, expert, activated[start:end]))
        adapt("down", expert, activated[start:end], outputs[-1], start, end)
    return torch.cat(outputs)


def _combine_pairs(x: torch.Tensor, output: torch.Tensor, pair_weights: torch.Tensor, experts: torch.Tensor,
                   order: torch.Tensor, counts: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Each token's weighted expert outputs added onto zeros in ascending expert order,
    each product rounded to x's dtype and each add rounded (transformers' order):
    ``output`` [pairs, hidden] grouped by expert as ``order`` sorts them."""
    if x.device.type == "cpu" and x.dtype in cpu_ops.ACTIVATIONS and cpu_ops.available():
        num_tokens, top_k = experts.shape
        position = torch.full((num_tokens * top_k,), -1, dtype=torch.int64)  # of each (token, choice) in output
        position[order] = torch.arange(order.shape[0])
        pairs = position.view(num_tokens, top_k).gather(1, experts.argsort(dim=1))  # ascending expert
        return cpu_ops.moe_combine(output, pair_weights.float(), pairs)
    contributions = (output * pair_weights.unsqueeze(-1)).to(x.dtype)  # [pairs, hidden]
    out = torch.zeros_like(x)
    # A token chose each expert at most once: one add per token and expert, ascending, each
    # rounded (one index_add_ over every pair would add a token's experts before rounding).
    for start, count in zip(itertools.accumulate(counts, initial=0), counts):  # noqa: B905 (one more start)
        if count:
            out.index_add_(0, tokens[start:start + count], contributions[start:start + count])
    return out


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor, biases: ExpertBiases | None = None,
                      activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The oracle of ``experts_grouped``: token by token, its experts in ascending order,
    in plain PyTorch ops (``activation`` None: SwiGLU written out)."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in sorted(range(experts.shape[1]), key=lambda j: int(experts[token, j])):
            expert = int(experts[token, slot])
            projected = F.linear(x[token:token + 1], gate_up[expert])  # [1, 2 * inter]
            if biases is not None:
                projected = projected + biases[0][expert]
            if activation is None:
                gate, up = projected.chunk(2, dim=-1)  # [1, inter] each
                activated = F.silu(gate) * up
            else:
                activated = activation(projected)
            y = F.linear(activated, down[expert])[0]  # [hidden]
            if biases is not None:
                y = y + biases[1][expert]
            out[token] += (y * weights[token, slot]).to(x.dtype)
    return out


class SharedExpert(GatedMLP):
    """The shared expert: a GatedMLP (this rank's share of its features) whose partial
    sum is returned un-reduced; SparseMoE all-reduces it with the routed experts'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial: torch.Tensor = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return partial


class SharedUngatedExpert(UngatedMLP):
    """The shared expert of experts without a gate (Nemotron 3's): fc2(act(fc1(x))), its
    partial sum returned un-reduced as SharedExpert's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial: torch.Tensor = self.fc2(ops.plain_activation(self.fc1(x), self.form))
        return partial


class SparseMoE(nn.Module):
    """The MoE FFN of one decoder layer: ``forward(x [tokens, hidden]) -> [tokens,
    hidden]``, all-reduced under tensor parallel. Parameters (this rank's share of the
    intermediate features ``inter``): ``router.weight`` [experts, hidden],
    ``router.score_correction_bias`` [experts] (V3), ``experts_gate_up`` [experts,
    2 * inter, hidden], ``experts_down`` [experts, hidden, inter], ``shared_expert``
    (gate_up_proj / down_proj) and ``shared_expert_gate`` [1, hidden] (Qwen2-MoE).
    ``load_hf`` and ``weight_slice`` take checkpoint names inside the block."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.moe = moe
        self.tp = tp
        # Tensor parallel: every expert's share of the features; expert parallel: the rank's
        # experts [first_expert, first_expert + num_local_experts) whole.
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        self.first_expert, last = column_split(moe.num_experts, tp.rank, tp.size) if self.expert_parallel else (
            0, moe.num_experts)
        self.num_local_experts = last - self.first_expert
        start, end = (0, moe.intermediate_size) if self.expert_parallel else column_split(
            moe.intermediate_size, tp.rank, tp.size)
        self.intermediate_size = end - start  # this rank's features of each expert it holds
        self.router = MoERouter(hidden_size, moe)
        # The routed experts: dense, or 4-bit as an MXFP4 checkpoint stores them.
        self.mxfp4 = (MXFP4Experts(self.num_local_experts, hidden_size, self.intermediate_size)
                      if moe.mxfp4_experts else None)
        if self.mxfp4 is None:  # gate | up (up alone for experts without a gate)
            self.experts_gate_up = nn.Parameter(torch.zeros(self.num_local_experts,
                                                            (2 if moe.gated else 1) * self.intermediate_size,
                                                            hidden_size))
            self.experts_down = nn.Parameter(torch.zeros(self.num_local_experts, hidden_size,
                                                         self.intermediate_size))
        # GPT-OSS's biases after each matmul; under tensor parallel the down bias is held by
        # rank 0 alone (zeros elsewhere), as it joins the ranks' partial sums once.
        self.experts_gate_up_bias = (nn.Parameter(torch.zeros(self.num_local_experts, 2 * self.intermediate_size))
                                     if moe.expert_biases else None)
        self.experts_down_bias = (nn.Parameter(torch.zeros(self.num_local_experts, hidden_size))
                                  if moe.expert_biases else None)
        self.activation = expert_activation(moe)
        self.shared_expert: SharedExpert | SharedUngatedExpert | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = (SharedExpert(hidden_size, moe.shared_expert_intermediate_size, False, tp)
                                  if moe.gated else SharedUngatedExpert("a shared expert", hidden_size,
                                                                        moe.shared_expert_intermediate_size, False,
                                                                        moe.hidden_act, tp))
        self.shared_expert_gate = nn.Parameter(torch.zeros(1, hidden_size)) if moe.shared_expert_gate else None
        # Set by pack(): each expert's two matmuls as the kernel's layers (the 3D tensors
        # are then released), and the shared expert's gate.
        self.packed_experts: nn.ModuleList | None = None
        self.grouped: GroupedExperts | None = None  # the same weights for the grouped GEMM (invariant only)
        self._packed_pairs: list[tuple[nn.Module, nn.Module]] | None = None  # the same layers, as pairs
        self.packed_shared_gate: nn.Module | None = None
        # LoRA adapters on the routed experts (set by kvloom/lora's manager); None: none.
        self.adapters: ExpertAdapters | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs, adapters, biases, grouped = self._packed_pairs, self.adapters, self._biases(), self.grouped
        return self._combine(x, lambda x, gate_up, down, weights, experts: experts_grouped(
            x, gate_up, down, weights, experts, packed=pairs, adapters=adapters, biases=biases,
            activation=self.activation, grouped=grouped))

    def _expert_tensors(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up, down) as dense tensors, or (None, None) once packed; 4-bit experts not
        packed yet dequantized for the call (the reference path)."""
        if self.packed_experts is not None:
            return None, None
        if self.mxfp4 is not None:
            return self.mxfp4.dequantized(dtype)
        return self.experts_gate_up, self.experts_down

    def _biases(self) -> ExpertBiases | None:
        if self.experts_gate_up_bias is None or self.experts_down_bias is None:
            return None
        return self.experts_gate_up_bias, self.experts_down_bias

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with the experts run by the per-token loop (tests' oracle; before pack)."""
        if self.packed_experts is not None:
            raise RuntimeError("forward_reference needs the experts' tensors, which pack() released")
        if self.expert_parallel:
            raise RuntimeError("forward_reference runs every expert: not on an expert-parallel rank's share")
        biases, activation = self._biases(), self.activation if self.moe.hidden_act != "silu" else None  # SwiGLU's own
        return self._combine(x, lambda x, gate_up, down, weights, experts: experts_reference(
            x, gate_up, down, weights, experts, biases=biases, activation=activation))

    def pack(self, matmul: str) -> int:
        """Every expert's gate/up and down and the shared expert's gate as ``matmul``'s
        packed layers (models/packed_linear.py), where it applies (bf16 on CPU): so the
        routed experts are batch-invariant like every other matmul (the router packs
        itself; ``pack_linear_layers`` calls both). For ``invariant`` the block's experts
        share one buffer on 2 MiB pages, every expert's gate/up weight and then every
        expert's down weight, which the grouped GEMM runs a layer's experts from in two
        calls. Returns how many layers were packed; 0 leaves the module as it was."""
        if self.mxfp4 is not None and self.mxfp4.runs_here():  # 4-bit: the MXFP4 kernel's layers, whatever matmul
            pairs = self.mxfp4.layers()
        else:
            if self.mxfp4 is not None:  # no kernel here (a GPU): the dense experts, then as any others
                dtype = self.router.weight.dtype
                gate_up, down = self.mxfp4.dequantized(dtype)
                self.experts_gate_up, self.experts_down = nn.Parameter(gate_up), nn.Parameter(down)
                self.mxfp4 = None
            gate_up, down = self.experts_gate_up, self.experts_down
            if matmul == "invariant" and can_pack_invariant(gate_up):
                pairs = self._pack_grouped(gate_up, down)
            else:
                layers = packed_linears([(weight[e], None) for e in range(self.num_local_experts)
                                         for weight in (gate_up, down)], matmul)
                pairs = [(a, b) for a, b in zip(layers[0::2], layers[1::2], strict=True)
                         if a is not None and b is not None]
                if len(pairs) < self.num_local_experts:
                    return 0
            del self.experts_gate_up, self.experts_down  # the packed copies are what runs now
        self.packed_experts = nn.ModuleList(nn.ModuleList(pair) for pair in pairs)  # registered: .to() moves them
        self._packed_pairs = pairs
        if self.shared_expert_gate is not None:
            self.packed_shared_gate = packed_linear(self.shared_expert_gate, None, matmul)
        return 2 * len(pairs) + int(self.packed_shared_gate is not None)

    def _pack_grouped(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[nn.Module, nn.Module]]:
        """Every expert's gate/up weight, then every expert's down weight, packed into one
        buffer for the grouped GEMM (``self.grouped``); each expert's pair of layers are
        views of it (the LoRA path's matmuls)."""
        gate_ups, downs = gemm.pack_weight_groups([list(gate_up.unbind()), list(down.unbind())])
        pairs: list[tuple[nn.Module, nn.Module]] = [
            (InvariantLinear(gate_up[e], None, packed=gate_ups[e]), InvariantLinear(down[e], None, packed=downs[e]))
            for e in range(self.num_local_experts)]
        self.grouped = GroupedExperts(gate_ups, downs, gate_up.shape[1], gate_up.shape[2],
                                      pairs[0][0].isa)  # type: ignore[arg-type]
        return pairs

    def _combine(self, x: torch.Tensor, run_experts: Callable[..., torch.Tensor]) -> torch.Tensor:
        weights, experts = self.router(x)
        if self.moe.round_routing_weights:
            weights = weights.to(x.dtype)
        if self.expert_parallel:  # the rank's experts by their index here; the others' past the last (skipped)
            local = experts - self.first_expert
            experts = local.masked_fill((local < 0) | (local >= self.num_local_experts), self.num_local_experts)
        out = run_experts(x, *self._expert_tensors(x.dtype), weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                gate_logit = (self.packed_shared_gate(x) if self.packed_shared_gate is not None
                              else F.linear(x, self.shared_expert_gate))
                if isinstance(self.packed_shared_gate, InvariantLinear) and cpu_ops.available():
                    cpu_ops.sigmoid_gate_(shared, gate_logit)  # the native walk's kernel
                else:
                    shared = torch.sigmoid(gate_logit) * shared
            out = out + shared
        return self.tp.all_reduce(out)

    # ---- loading ---------------------------------------------------------------------
    def weight_slice(self, name: str) -> TensorSlice | None:
        """The part of block tensor ``name`` (e.g. ``experts.3.up_proj.weight``) this
        rank reads; None: all of it."""
        return moe_weight_slice(self.moe, name, self.tp.rank, self.tp.size, self.tp.expert_parallel)

    def load_hf(self, name: str, tensor: torch.Tensor) -> dict[str, int]:
        """Copy checkpoint tensor ``name`` (inside the block: ``gate.weight``,
        ``gate.e_score_correction_bias``, ``experts.N.{gate,up,down}_proj.weight`` or
        Mixtral's ``experts.N.w1/w3/w2.weight``, the fused ``experts.gate_up_proj`` /
        ``experts.down_proj``, ``shared_expert(s).*_proj.weight``,
        ``shared_expert_gate.weight``), already cut to ``weight_slice``, into this
        module. Returns {parameter name inside this module: elements copied}; raises
        ValueError on a name or shape that is not this module's."""
        part = moe_tensor(name)
        if part is None:
            raise ValueError(f"unexpected tensor {name!r} in a mixture-of-experts block")
        if self.moe.gpt_oss_layout:
            tensor = gpt_oss_experts(part.part, tensor)
        if part.expert is not None and part.expert >= self.moe.num_experts:
            raise ValueError(f"tensor {name!r} names expert {part.expert}; the model has {self.moe.num_experts}")
        if part.expert is not None and self.expert_parallel:
            if not self.first_expert <= part.expert < self.first_expert + self.num_local_experts:
                return {}  # another rank's expert (read as nothing: weight_slice)
            part = MoETensor(part.part, part.expert - self.first_expert)
        if part.part in ("gate_up", "gate_up_bias", "gate_up_blocks", "gate_up_scales") and not self.expert_parallel:
            # [E, 2 * full inter, ...]: this rank's rows of gate and of up
            full = tensor.shape[1] // 2
            start, end = column_split(full, self.tp.rank, self.tp.size)
            tensor = torch.cat((tensor[:, start:end], tensor[:, full + start:full + end]), dim=1)
        if part.part == "down" and self.moe.gpt_oss_layout and part.expert is None and not self.expert_parallel:
            start, end = column_split(tensor.shape[2], self.tp.rank, self.tp.size)  # read whole (weight_slice)
            tensor = tensor[:, :, start:end]
        if part.part in ("down_blocks", "down_scales") and not self.expert_parallel:
            groups = tensor.shape[2]  # [E, hidden, inter / 32, ...]: this rank's groups of inputs
            start, end = column_split(groups, self.tp.rank, self.tp.size)
            tensor = tensor[:, :, start:end]
        if part.part == "down_bias" and not self.expert_parallel and self.tp.rank > 0:
            tensor = torch.zeros_like(tensor)  # added once, by rank 0, to the partial sums
        parameter, dest = self._destination(name, part)
        if dest.shape != tensor.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        return {parameter: tensor.numel()}

    def _destination(self, name: str, part: MoETensor) -> tuple[str, torch.Tensor]:
        """(parameter name, the part of its data) that block tensor ``part`` fills."""
        inter = self.intermediate_size
        if part.expert is not None:
            if part.part == "down":
                return "experts_down", self.experts_down.data[part.expert]
            if not self.moe.gated and part.part == "gate":
                raise ValueError(f"checkpoint has an unexpected tensor {name!r}: this model's experts have no gate")
            rows = (slice(0, inter) if part.part == "gate" else
                    slice(inter, 2 * inter) if self.moe.gated else slice(0, inter))
            return "experts_gate_up", self.experts_gate_up.data[part.expert, rows]
        places: dict[str, tuple[str, torch.Tensor | None, slice]] = {
            "router": ("router.weight", self.router.weight, slice(None)),
            "score_correction_bias": ("router.score_correction_bias", self.router.score_correction_bias,
                                      slice(None)),
            "router_bias": ("router.bias", self.router.bias, slice(None)),
            "gate_up_bias": ("experts_gate_up_bias", self.experts_gate_up_bias, slice(None)),
            "down_bias": ("experts_down_bias", self.experts_down_bias, slice(None)),
            "gate_up": ("experts_gate_up", getattr(self, "experts_gate_up", None) if self.moe.gated else None,
                        slice(None)),
            "up": ("experts_gate_up", None if self.moe.gated else getattr(self, "experts_gate_up", None),
                   slice(None)),  # every expert's up, fused (experts without a gate)
            "down": ("experts_down", getattr(self, "experts_down", None), slice(None)),
            "shared_gate": ("shared_expert_gate", self.shared_expert_gate, slice(None)),
        }
        if self.mxfp4 is not None:
            for kind in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"):
                places[kind] = (f"mxfp4.{kind}", getattr(self.mxfp4, kind), slice(None))
        shared = self.shared_expert
        if isinstance(shared, SharedUngatedExpert):
            places["shared_up_proj"] = ("shared_expert.fc1.weight", shared.fc1.weight, slice(None))
            places["shared_down_proj"] = ("shared_expert.fc2.weight", shared.fc2.weight, slice(None))
        elif shared is not None:
            width = shared.intermediate_size
            places["shared_gate_proj"] = ("shared_expert.gate_up_proj.weight", shared.gate_up_proj.weight,
                                          slice(0, width))
            places["shared_up_proj"] = ("shared_expert.gate_up_proj.weight", shared.gate_up_proj.weight,
                                        slice(width, 2 * width))
            places["shared_down_proj"] = ("shared_expert.down_proj.weight", shared.down_proj.weight, slice(None))
        parameter, param, rows = places.get(part.part, ("", None, slice(None)))
        if param is None:
            raise ValueError(f"checkpoint has an unexpected tensor {name!r}: this model's MoE has no {part.part}")
        return parameter, param.data[rows]


def gpt_oss_experts(part: str, tensor: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's fused expert tensor (``part`` as ``moe_tensor`` names it) in the layout the
    other families' fused tensors have: gate_up [E, hidden, 2 * inter] (gate and up
    columns alternating) -> [E, 2 * inter, hidden] gate | up, its bias [E, 2 * inter] the
    same way; down [E, inter, hidden] -> [E, hidden, inter]; anything else as it is."""
    if part == "gate_up":
        tensor = tensor.transpose(1, 2)
    if part in ("gate_up", "gate_up_bias", "gate_up_blocks", "gate_up_scales"):  # the MXFP4 ones [E, 2 inter, ...]
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    if part == "down":
        return tensor.transpose(1, 2)
    return tensor
