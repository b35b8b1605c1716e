"""Mamba2 (``Mamba2ForCausalLM``): a stack of state-space mixers, no attention.

The mixer (also Bamba's, models/bamba.py) projects each token to a gate z, the
convolution's input xBC and a time step dt; convolves xBC causally (per channel, over
the request's last ``conv_kernel`` inputs) and applies silu; scans x with B, C, dt, A
and D (models/ssm_ops.py), starting from the request's stored state; then a gated
RMSNorm (by groups) and the output projection. Its state lives in two tensors per
layer, indexed by the requests' state slots (cache/state_pool.py keeps the books):
``conv_state`` [slots, conv_kernel - 1, conv_dim] in the model's dtype (oldest input
first, each a row of channels: the native kernels read and write it contiguously) and
``ssm_state`` [slots, heads, head_dim, d_state] in float32 (the scan's own precision),
allocated once by ``allocate_state``. transformers 5.24's modeling_mamba2.py is the
reference these numbers follow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.attention.base import AttentionBackend
from kvloom.batch import ForwardBatch, StateCopy
from kvloom.config import ModelConfig
from kvloom.distributed.group import SINGLE_PROCESS, TensorParallelGroup
from kvloom.model_families import SSMConfig
from kvloom.models import ssm_ops
from kvloom.models.layers import RMSNorm, VocabParallelEmbedding
from kvloom.models.packed_linear import pack_with_tied_head
from kvloom.models.registry import CausalLM
from kvloom.models.weights import WeightFiller


class NativeMixerParams(NamedTuple):
    """A Mamba2 mixer's parameters besides its projections as the kernels and the
    references take them, float32: the convolution's, dt_bias, A_log and D."""

    conv: ssm_ops.ConvParams
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor


class SlotStateLayer(nn.Module):
    """A layer that keeps a fixed-size state per request in the state slots (cache/
    state_pool.py's books): Mamba2's mixer, LFM2's short convolution (models/short_conv.py).
    ``allocate_state`` gives it its per-slot tensors (zeros) and returns their bytes;
    ``copy_state`` copies slots ``src[i]`` to ``dst[i]`` (a prefix-cache checkpoint saved or
    restored); ``state_device`` is where its tensors are."""

    def allocate_state(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def state_device(self) -> torch.device:
        raise NotImplementedError


class Mamba2Mixer(SlotStateLayer):
    def __init__(self, hidden_size: int, ssm: SSMConfig) -> None:
        super().__init__()
        self.ssm = ssm
        self.in_proj = nn.Linear(hidden_size, ssm.intermediate_size + ssm.conv_dim + ssm.num_heads,
                                 bias=ssm.use_bias)
        self.conv1d = nn.Conv1d(ssm.conv_dim, ssm.conv_dim, ssm.conv_kernel, groups=ssm.conv_dim,
                                bias=ssm.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(ssm.num_heads))
        self.A_log = nn.Parameter(torch.zeros(ssm.num_heads))
        self.D = nn.Parameter(torch.ones(ssm.num_heads))
        self.norm = RMSNorm(ssm.intermediate_size, ssm.norm_eps)  # the gated norm's weight
        self.out_proj = nn.Linear(ssm.intermediate_size, hidden_size, bias=ssm.use_bias)
        # How a step is scanned: "native" (kernels/ssm.py, every chunk token by token in one
        # call, where it runs: a float32 state on a CPU; else "ssd"), or by the references:
        # decodes batched, each longer chunk by "ssd" (chunked) or "sequential".
        self.prefill_scan = "native"
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)
        # The float32 parameters, made once by pack (after the weights load).
        self.packed_params: NativeMixerParams | None = None

    def pack(self, matmul: str) -> int:
        """Make the float32 parameters once (both paths take them so; at decode their
        conversion cost as much as a layer's convolution). Packs no matmul: in_proj and
        out_proj are nn.Linear layers, packed as every other."""
        self.packed_params = self.params()
        return 0

    def params(self) -> NativeMixerParams:
        """The float32 parameters: packed, or made now (a mixer used before pack)."""
        if self.packed_params is not None:
            return self.packed_params
        return NativeMixerParams(ssm_ops.ConvParams.of(self.conv1d), self.dt_bias.float(), self.A_log.float(),
                                 self.D.float())

    def allocate_state(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> int:
        """The per-slot state tensors (zeros); returns their bytes."""
        ssm = self.ssm
        self.conv_state = torch.zeros(num_slots, ssm.conv_kernel - 1, ssm.conv_dim, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(num_slots, ssm.num_heads, ssm.head_dim, ssm.state_size,
                                     dtype=torch.float32, device=device)
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots ``src[i]`` -> ``dst[i]`` (the sources are gathered before any is written)."""
        self.conv_state.index_copy_(0, dst, self.conv_state[src])
        self.ssm_state.index_copy_(0, dst, self.ssm_state[src])

    @property
    def state_device(self) -> torch.device:
        return self.ssm_state.device

    def forward(self, hidden: torch.Tensor, spans: ssm_ops.SSMSpans) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]; reads and writes the requests' slots."""
        if not self.ssm_state.numel():
            raise RuntimeError("a Mamba2 mixer runs only after allocate_state gave it its state slots")
        ssm, num_tokens = self.ssm, hidden.shape[0]
        heads, head_dim, groups, d_state = ssm.num_heads, ssm.head_dim, ssm.num_groups, ssm.state_size
        proj = self.in_proj(hidden)
        params = self.params()
        if self.prefill_scan == "native" and ssm_ops.native_mixer_applies(proj, self.conv_state, self.ssm_state,
                                                                          head_dim, d_state, ssm.conv_kernel):
            normed = ssm_ops.mixer_native(proj, params.conv, self.conv_state, self.ssm_state, params.dt_bias,
                                          params.A_log, params.D, self.norm.weight, spans, groups,
                                          ssm.time_step_limit, ssm.norm_eps)
            native: torch.Tensor = self.out_proj(normed)
            return native
        gate, xbc, dt = proj.split([ssm.intermediate_size, ssm.conv_dim, heads], dim=-1)
        xbc = F.silu(ssm_ops.causal_conv(xbc, params.conv, self.conv_state, spans))
        x, B, C = torch.split(xbc, [ssm.intermediate_size, groups * d_state, groups * d_state], dim=-1)
        x = x.reshape(num_tokens, heads, head_dim).float()  # [tokens, heads, head_dim]
        B = B.reshape(num_tokens, groups, d_state).float().repeat_interleave(heads // groups, dim=1)
        C = C.reshape(num_tokens, groups, d_state).float().repeat_interleave(heads // groups, dim=1)
        dt = F.softplus(dt.float() + params.dt_bias).clamp(*ssm.time_step_limit)  # [tokens, heads]
        y = self._scan(x, dt, -torch.exp(params.A_log), B, C, params.D, spans)
        y = y.reshape(num_tokens, ssm.intermediate_size).to(hidden.dtype)
        out: torch.Tensor = self.out_proj(gated_rms_norm(y, gate, self.norm.weight, ssm.intermediate_size // groups,
                                                         ssm.norm_eps))
        return out  # [tokens, hidden]

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor, spans: ssm_ops.SSMSpans) -> torch.Tensor:
        """y [tokens, heads, head_dim], every final state back into its slot: natively in one
        call, or one-token chunks (decodes) in one batched step of the reference and
        longer chunks one request at a time."""
        if self.prefill_scan == "native" and ssm_ops.native_scan_applies(self.ssm_state):
            return ssm_ops.scan_native_(self.ssm_state, spans, x, dt, A, B, C, D)
        y = torch.empty_like(x)
        if spans.decode_tokens.numel():
            tokens, slots = spans.decode_tokens, spans.slots[spans.decode_requests]
            stored = self.ssm_state[slots]  # a copy, updated in place, then stored back
            stored[~spans.has_state_mask[spans.decode_requests]] = 0  # a 1-token prompt starts from zero
            y[tokens] = ssm_ops.selective_state_update_(stored, x[tokens], dt[tokens], A, B[tokens], C[tokens], D)
            self.ssm_state.index_copy_(0, slots, stored)
        for i in spans.prefill_requests:
            start, end, slot = spans.token_starts[i], spans.token_starts[i] + spans.lengths[i], spans.slots[i]
            initial = self.ssm_state[slot] if spans.has_state[i] else torch.zeros_like(self.ssm_state[0])
            args = (x[start:end], dt[start:end], A, B[start:end], C[start:end], D, initial)
            y[start:end], final = (ssm_ops.sequential_scan(*args) if self.prefill_scan == "sequential"
                                   else ssm_ops.ssd_scan(*args, self.ssm.chunk_size))
            self.ssm_state[slot] = final
        return y


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """weight * rmsnorm(y * silu(gate)), normalised over groups of ``group_size``
    features, in float32 then cast to y's dtype (transformers' MambaRMSNormGated)."""
    gated = y.float() * F.silu(gate.float())
    grouped = gated.view(*gated.shape[:-1], -1, group_size)  # [tokens, groups, group_size]
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view_as(gated).to(y.dtype)


class Mamba2Block(nn.Module):
    def __init__(self, config: ModelConfig, ssm: SSMConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = Mamba2Mixer(config.hidden_size, ssm)


class Mamba2ForCausalLM(nn.Module):
    """No attention: ``kv_caches`` (a pool of no layers) and ``backend`` go unused."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        if config.ssm is None or tp.size > 1:
            raise ValueError("Mamba2ForCausalLM needs an SSM config and runs in one process")
        self.config, self.ssm = config, config.ssm
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = [Mamba2Block(config, config.ssm) for _ in range(config.num_layers)]
        self.layers = nn.ModuleList(self.blocks)  # registered; ``blocks`` is the typed view
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (None if config.tie_word_embeddings else
                                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, batch: ForwardBatch, kv_caches: torch.Tensor, backend: AttentionBackend[Any],
                metadata: Any) -> torch.Tensor:
        spans = ssm_ops.SSMSpans.of(batch, self.ssm.conv_kernel)
        hidden = self.embeddings(batch.input_ids)  # [tokens, hidden]
        dtype = hidden.dtype
        residual = hidden.float() if self.ssm.residual_in_fp32 else hidden
        for layer in self.blocks:
            residual = residual + layer.mixer(layer.norm(residual.to(dtype)), spans)
        final: torch.Tensor = self.norm_f(residual)
        return batch.final_states(final.to(dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embeddings.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def allocate_state(self, num_slots: int) -> int:
        return allocate_mixer_state(self, num_slots)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, ((name.removeprefix("backbone.").replace("embedding.", "embeddings."), tensor)
                                  for name, tensor in weights), {})

    def weight_slice(self, hf_name: str) -> None:
        return None

    def pack_weights(self, matmul: str = "invariant") -> int:
        return pack_with_tied_head(self, self.embeddings.weight, matmul)

    def use_native_stack(self) -> str | None:
        return "the native decoder stack walks attention layers; Mamba2 has none"

    def first_layers(self, num_layers: int) -> CausalLM:
        raise ValueError("layer_skip drafts are not supported for state-space models")


@runtime_checkable
class StatefulModel(Protocol):
    def allocate_state(self, num_slots: int) -> int: ...


def allocate_state(model: CausalLM, num_slots: int) -> int:
    """Give a state-space model's mixers ``num_slots`` state slots; returns the bytes."""
    if not isinstance(model, StatefulModel):
        raise TypeError(f"{type(model).__name__} keeps no per-request state")
    return model.allocate_state(num_slots)


def copy_state(model: CausalLM, copies: Sequence[StateCopy]) -> None:
    """Every mixer layer's state from each copy's source slot to its destination (a
    prefix-cache hit's checkpoint, or a state saved as one: cache/kv_manager.py)."""
    mixers = [m for m in model.modules() if isinstance(m, SlotStateLayer)] if isinstance(model, nn.Module) else []
    if not mixers:
        raise TypeError(f"{type(model).__name__} keeps no per-request state")
    device = mixers[0].state_device
    src = torch.tensor([copy.src for copy in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([copy.dst for copy in copies], dtype=torch.int64, device=device)
    for mixer in mixers:
        mixer.copy_state(src, dst)


def allocate_mixer_state(model: nn.Module, num_slots: int) -> int:
    """Every state layer's tensors (``SlotStateLayer``), on the device and in the dtype of the model."""
    reference = next(p for p in model.parameters() if p.is_floating_point())
    return sum(module.allocate_state(num_slots, reference.device, reference.dtype)
               for module in model.modules() if isinstance(module, SlotStateLayer))


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       fused: dict[str, tuple[str, int, int]], filler: WeightFiller | None = None) -> None:
    """Copy tensors named as ``model``'s parameters in; ``fused`` maps a name fragment
    to (our fused parameter's fragment, row offset, rows). Raises on an unknown name, a
    wrong shape or a parameter left unset (``filler``: one that ``weights`` also fills as
    it is read)."""
    filler = WeightFiller(model) if filler is None else filler
    for name, tensor in weights:
        if name == "lm_head.weight" and "lm_head.weight" not in filler:
            continue  # tied: the embedding table is the head
        target, rows = name, None
        for fragment, (ours, start, length) in fused.items():
            if f".{fragment}." in name:
                target, rows = name.replace(fragment, ours), slice(start, start + length)
                break
        filler.copy(target, tensor, name, rows)
    filler.check_complete()
