"""The arithmetic of a Mamba2 mixer over a flat, mixed batch: pure PyTorch, and the
native kernels (kernels/ssm.py: the scan, the convolution, the whole mixer) where they run.

Each request's tokens are contiguous in the flat batch; each request owns a state
slot (cache/state_pool.py) where every mixer layer keeps, between steps, its causal
convolution's last ``k - 1`` inputs and its SSM state ``[heads, head_dim, d_state]``.
A chunk that starts at token 0 starts from a zero state; a later chunk (chunked
prefill, a decode) from the slot's stored state, and leaves its own final state there.

- ``causal_conv``: the depthwise causal convolution of every token at once, windows
  reaching back into the stored inputs (natively on a CPU; ``causal_conv_reference``
  elsewhere).
- ``selective_state_update``: one recurrent step for a batch of requests; applied
  token by token (``sequential_scan``) it is the reference of the scan.
  ``scan_native_`` runs that recurrence for a whole step (prompts' chunks and decodes)
  against the layer's slots in one native call on a CPU (kernels/ssm.py), each state
  staying in cache across its chunk.
- ``ssd_scan``: the chunked state-space-duality form of the same scan (Mamba2's
  prefill algorithm, as transformers' ``torch_forward`` computes it), tested against
  the sequential one; the model uses it for chunks of more than one token where the
  native scan does not run.

Numbers follow transformers' Mamba2 (scan in float32; softplus(dt + dt_bias), clamped
to ``time_step_limit``, which transformers applies only to prefill: with the default
limits (0, inf) the clamp changes nothing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class SSMSpans:
    """Where each request's tokens and state are, once per step for every mixer layer.

    The reference convolution reads an extended sequence: the ``k - 1`` stored inputs of
    every request (rows ``i * (k - 1) ...``), then the step's tokens (rows ``n * (k - 1) +
    t``); its row indices are built when it asks (``conv_rows``): the native kernels take
    the spans as they are, and a long prompt's rows cost a Python loop over its tokens."""

    token_starts: list[int]
    lengths: list[int]
    has_state: list[bool]  # the chunk continues from the slot's state (it starts past token 0)
    slots: torch.Tensor  # [n] int64
    has_state_mask: torch.Tensor  # [n] bool
    # The same as tensors, for the native kernels: [n] int64, int64, int32.
    starts_tensor: torch.Tensor
    lengths_tensor: torch.Tensor
    has_state_int: torch.Tensor
    decode_requests: torch.Tensor  # [d] requests whose chunk is one token: scanned together
    decode_tokens: torch.Tensor  # [d] their tokens
    prefill_requests: list[int]  # requests with longer chunks: scanned one by one
    conv_kernel: int

    @classmethod
    def of(cls, batch: ForwardBatch, conv_kernel: int) -> SSMSpans:
        if batch.state_slots is None or batch.state_slots.numel() != batch.num_seqs:
            raise ValueError("a state-space model needs a state slot for every request of the batch")
        lengths = batch.query_lens_list
        has_state = [seq > query for seq, query in zip(batch.seq_lens_list, lengths, strict=True)]
        starts = [0] * len(lengths)
        for i in range(1, len(lengths)):
            starts[i] = starts[i - 1] + lengths[i - 1]
        device = batch.input_ids.device
        decodes = [i for i, length in enumerate(lengths) if length == 1]

        def tensor(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(starts, lengths, has_state, batch.state_slots, tensor(has_state, torch.bool),
                   tensor(starts, torch.int64), tensor(lengths, torch.int64), tensor(has_state, torch.int32),
                   tensor(decodes, torch.int64), tensor([starts[i] for i in decodes], torch.int64),
                   [i for i, length in enumerate(lengths) if length > 1], conv_kernel)

    def conv_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(windows [tokens, k]: each token's rows of the extended sequence, oldest first;
        tails [n, k - 1]: the rows that become each request's stored inputs)."""
        n, kernel, tail = len(self.lengths), self.conv_kernel, self.conv_kernel - 1
        windows: list[list[int]] = []
        tails: list[list[int]] = []
        for i, (first, length) in enumerate(zip(self.token_starts, self.lengths, strict=True)):
            def row(m: int, i: int = i, first: int = first) -> int:  # extended position m of request i
                return i * tail + m if m < tail else n * tail + first + m - tail
            windows.extend([row(j + w) for w in range(kernel)] for j in range(length))
            tails.append([row(length + w) for w in range(tail)])
        device = self.slots.device
        return (torch.tensor(windows, dtype=torch.int64, device=device),
                torch.tensor(tails, dtype=torch.int64, device=device))


class ConvParams(NamedTuple):
    """A depthwise causal convolution's parameters as both paths take them, float32: the
    weight transposed, [k, channels], and the bias (or None). Its layer makes them once,
    when the model is packed (``of``): converting them each call cost a decode's layer as
    much as the convolution itself."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, conv: nn.Conv1d) -> ConvParams:
        weight = conv.weight.view(conv.weight.shape[0], -1)  # [channels, k]
        return cls(weight.t().float().contiguous(), None if conv.bias is None else conv.bias.float())


def causal_conv(xbc: torch.Tensor, conv: ConvParams, conv_state: torch.Tensor, spans: SSMSpans) -> torch.Tensor:
    """The depthwise causal convolution (before its activation) of the step's tokens,
    ``xbc`` [tokens, channels], with ``conv``; stores each request's last ``k - 1`` inputs
    in ``conv_state`` [slots, k - 1, channels]. Returns [tokens, channels] in xbc's dtype
    (summed in float32). On a CPU one native pass (kernels/ssm.py); elsewhere
    ``causal_conv_reference``."""
    if native_conv_applies(xbc, conv_state, conv):
        from kvloom.kernels import ssm

        return ssm.causal_conv(xbc.contiguous(), conv.weight_t, conv.bias, conv_state, spans.starts_tensor,
                               spans.lengths_tensor, spans.slots, spans.has_state_int)
    return causal_conv_reference(xbc, conv, conv_state, spans)


def causal_conv_reference(xbc: torch.Tensor, conv: ConvParams, conv_state: torch.Tensor,
                          spans: SSMSpans) -> torch.Tensor:
    """``causal_conv`` in PyTorch: the stored inputs gathered and joined to the tokens,
    each token's window gathered, multiplied and summed."""
    channels = conv.weight_t.shape[1]
    stored = conv_state[spans.slots]  # [n, k - 1, channels]
    stored = torch.where(spans.has_state_mask[:, None, None], stored, torch.zeros((), dtype=stored.dtype))
    extended = torch.cat([stored.reshape(-1, channels), xbc.to(stored.dtype)])  # [n(k-1) + T, C]
    rows, tails = spans.conv_rows()
    windows = extended[rows].float()  # [tokens, k, channels]
    out = (windows * conv.weight_t).sum(1)  # [tokens, channels]
    if conv.bias is not None:
        out = out + conv.bias
    conv_state.index_copy_(0, spans.slots, extended[tails])
    return out.to(xbc.dtype)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``n`` requests: state [n, heads, head_dim, d_state], x [n,
    heads, head_dim], dt [n, heads] (after softplus), A and D [heads], B and C [n, heads,
    d_state] (groups already repeated per head). Returns (y [n, heads, head_dim], the
    new state); h' = exp(dt A) h + dt B x, y = h' C + D x."""
    decay = torch.exp(dt * A)  # [n, heads]
    inputs = (dt[..., None] * B)[:, :, None, :] * x[..., None]  # [n, heads, head_dim, d_state]
    state = state * decay[..., None, None] + inputs
    y = (state @ C[..., None]).squeeze(-1)  # [n, heads, head_dim]
    return y + x * D[:, None], state


def selective_state_update_(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``selective_state_update`` with ``state`` updated in place (the decode step's
    hot path: the state, not the token, is what it moves, so two passes over it instead
    of the reference's five). Returns y [n, heads, head_dim]."""
    n, heads, head_dim, d_state = state.shape
    state.mul_(torch.exp(dt * A)[..., None, None])
    flat = state.view(n * heads, head_dim, d_state)
    flat.baddbmm_(x.reshape(n * heads, head_dim, 1), (dt[..., None] * B).reshape(n * heads, 1, d_state))
    y = torch.bmm(flat, C.reshape(n * heads, d_state, 1)).view(n, heads, head_dim)
    return y + x * D[:, None]


def native_scan_applies(state: torch.Tensor) -> bool:
    """Whether ``scan_native_`` runs on this layer's state: a float32 state on a CPU where
    kernels/ssm.py builds, of head_dim and d_state within the kernel's."""
    if not (state.device.type == "cpu" and state.dtype == torch.float32 and _native_ssm()):
        return False
    from kvloom.kernels import ssm

    return state.shape[2] <= ssm.MAX_HEAD_DIM and state.shape[3] <= ssm.MAX_STATE


def scan_native_(state: torch.Tensor, spans: SSMSpans, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Every request's chunk of the step scanned token by token from its slot in ``state``
    (zeros where it has none) in one native call, each final state left in its slot;
    x [tokens, heads, head_dim], dt [tokens, heads], B and C [tokens, heads, d_state]
    float32, A and D [heads]. Returns y [tokens, heads, head_dim]."""
    from kvloom.kernels import ssm

    return ssm.ssm_scan_(state, spans.slots, spans.has_state_int, spans.starts_tensor, spans.lengths_tensor,
                         x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(),
                         D.contiguous())


def native_mixer_applies(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                         head_dim: int, d_state: int, conv_kernel: int) -> bool:
    """Whether ``mixer_native`` runs: on a CPU, activations and the convolution's stored
    inputs in float32 or bf16 alike, a float32 SSM state, shapes within the kernel's."""
    if not (proj.device.type == "cpu" and proj.dtype in (torch.float32, torch.bfloat16)
            and conv_state.dtype == proj.dtype and ssm_state.dtype == torch.float32 and _native_ssm()):
        return False
    from kvloom.kernels import ssm

    return head_dim <= ssm.MAX_HEAD_DIM and d_state <= ssm.MAX_STATE and conv_kernel <= ssm.MAX_CONV_KERNEL


def mixer_native(proj: torch.Tensor, conv: ConvParams, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor,
                 spans: SSMSpans, groups: int, time_step_limit: tuple[float, float], eps: float) -> torch.Tensor:
    """A Mamba2 mixer between its projections in one native call (kernels/ssm.py): the
    in_proj output ``proj`` [tokens, z | xBC | dt] -> the gated norm's output [tokens,
    inter], the requests' stored inputs and states read from and left in their slots.
    ``dt_bias``, ``A_log`` and ``D`` float32 (as the reference takes them:
    models/mamba2.NativeMixerParams)."""
    from kvloom.kernels import ssm

    return ssm.mamba_mixer(proj.contiguous(), conv.weight_t, conv.bias, conv_state, ssm_state, dt_bias, A_log, D,
                           norm_weight, spans.starts_tensor, spans.lengths_tensor, spans.slots, spans.has_state_int,
                           groups, float(time_step_limit[0]), float(time_step_limit[1]), eps)


def native_conv_applies(x: torch.Tensor, conv_state: torch.Tensor, conv: ConvParams) -> bool:
    """Whether the native convolution runs (``causal_conv``'s, and LFM2's ``short_conv_native``
    around it): on a CPU, activations ``x`` and stored inputs in float32 or bf16 alike, a
    kernel within the convolution's."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and conv_state.dtype == x.dtype and _native_ssm() and conv.weight_t.shape[0] <= _max_native_kernel())


def short_conv_native(proj: torch.Tensor, conv: ConvParams, conv_state: torch.Tensor, spans: SSMSpans) -> torch.Tensor:
    """LFM2's gated short convolution between its projections in one native call
    (kernels/ssm.py): the in_proj output ``proj`` [tokens, B | C | x] -> ``C * conv(B * x)``
    [tokens, channels], the requests' stored inputs read from and left in their slots."""
    from kvloom.kernels import ssm

    return ssm.short_conv(proj.contiguous(), conv.weight_t, conv.bias, conv_state, spans.starts_tensor,
                          spans.lengths_tensor, spans.slots, spans.has_state_int)


@functools.cache
def _native_ssm() -> bool:
    from kvloom.kernels import ssm

    return ssm.available()


def _max_native_kernel() -> int:
    from kvloom.kernels import ssm

    return ssm.MAX_CONV_KERNEL


def sequential_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference scan of one request's chunk, token by token from ``state`` [heads,
    head_dim, d_state]: x [L, heads, head_dim], dt [L, heads], B and C [L, heads, d_state].
    Returns (y [L, heads, head_dim], the final state)."""
    ys = []
    current = state[None]
    for t in range(x.shape[0]):
        y, current = selective_state_update(current, x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D)
        ys.append(y)
    return torch.cat(ys), current[0]


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., l] -> [..., l, l]: entry (i, j) is a[j+1] + ... + a[i] for i >= j (0 on the
    diagonal), -inf above it; by masked cumulative sums (stable, no differences)."""
    length = a.shape[-1]
    # Built transposed, [..., l (j), l (k)], so that the running sums run along the
    # contiguous last dim (a cumsum across rows is several times slower on a CPU); the
    # additions are the same, in the same order.
    expanded = a[..., None, :].expand(*a.shape[:-1], length, length)  # [..., j, k]: a[k]
    above = torch.triu(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=1)
    sums = torch.cumsum(expanded.masked_fill(~above, 0), dim=-1)  # [..., j, i]: a[j+1] + ... + a[i]
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill_(~upper, -torch.inf).transpose(-1, -2)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequential_scan``'s result by the chunked (SSD) algorithm: within blocks of
    ``chunk_size`` tokens the scan is a masked, attention-like product; between blocks
    the states are passed on. Same arguments and results."""
    length, heads, head_dim = x.shape
    # A chunk shorter than a block is one block of its own length: padded to the block,
    # the 16 tokens after a prefix hit would cost a 256 x 256 mask per head.
    chunk_size = min(chunk_size, length)
    pad = (-length) % chunk_size

    # Head-major throughout ([h, c, l, ...]): every product below is a batched matmul over
    # (head, block) on views, with no permuted copies (the token-major form spent as long
    # copying as multiplying on a CPU).
    def blocks(t: torch.Tensor) -> torch.Tensor:  # [L, h, ...] -> [h, chunks, chunk_size, ...], zero-padded
        padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return padded.reshape(-1, chunk_size, *t.shape[1:]).movedim(2, 0).contiguous()

    xs = blocks(x * dt[..., None])  # [h, c, l, p]
    decays = blocks(A * dt)  # [h, c, l]
    Bs, Cs = blocks(B), blocks(C)  # [h, c, l, n]
    cumulative = torch.cumsum(decays, dim=-1)  # [h, c, l]
    # 1. Within each block: y_l = sum_{s <= l} (C_l . B_s) exp(A_s+1 + ... + A_l) x_s dt_s.
    scores = torch.matmul(Cs, Bs.transpose(-1, -2)) * torch.exp(segment_sum(decays))  # [h, c, l, s]
    y_diag = torch.matmul(scores, xs)  # [h, c, l, p]
    # 2. Each block's own contribution to the state at its end.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [h, c, l]
    block_states = torch.matmul(xs.transpose(-1, -2), Bs * to_end[..., None])  # [h, c, p, n]
    # 3. The state entering each block: the initial state and earlier blocks', decayed.
    block_states = torch.cat([state[:, None].to(block_states.dtype), block_states], dim=1)  # [h, c + 1, p, n]
    between = torch.exp(segment_sum(F.pad(cumulative[..., -1], (1, 0))))  # [h, c + 1, c + 1]
    entering = torch.matmul(between, block_states.flatten(2)).view_as(block_states)  # [h, c + 1, p, n]
    # 4. What the entering state adds to each position of its block.
    y_off = torch.matmul(Cs, entering[:, :-1].transpose(-1, -2)) * torch.exp(cumulative)[..., None]  # [h, c, l, p]
    y = (y_diag + y_off).flatten(1, 2)[:, :length].transpose(0, 1)  # [L, h, p]
    return y + x * D[:, None], entering[:, -1]
