"""Mamba2's mixer on a CPU (kvloom/csrc/ssm.cpp): ``kvloom::ssm_scan_``, the selective
scan of a flat batch (prompts' chunks and decodes alike), each request's float32 SSM state
updated in place in its state slot, and ``kvloom::causal_conv``, the depthwise causal convolution
of a flat batch over and into the slots' stored inputs (and LFM2's gated short convolution
around it, ``kvloom::short_conv``). models/ssm_ops.py calls them on CPU
and keeps the pure-PyTorch references (``sequential_scan`` and ``causal_conv``, the
oracles in tests/kernels/test_ssm_kernels.py, and what runs where this source does not
build or the tensors are not the kernels')."""

from __future__ import annotations

import torch

from kvloom.kernels.native_op import NativeOp, TensorSpec

_F32 = (torch.float32,)
MAX_HEAD_DIM = MAX_STATE = 512  # ssm.cpp's per-token staging of x, B and C (the scan's, both ops')


def available() -> bool:
    """Whether ssm.cpp builds here."""
    return SSM_SCAN.available()


def _raise_for(op: NativeOp, status: int, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               num_slots: int, tokens: int) -> None:
    """The error a kernel's status names (it checks the requests' slots and spans, data a
    fake tensor does not have, before it reads or writes anything): 1 a slot outside the
    state, 2 a span outside the tokens; 0 nothing."""
    if status == 1:
        raise op.error("slots", f"must lie in [0, {num_slots}), got {slots.tolist()}")
    if status == 2:
        raise op.error("starts", f"and lengths must name spans of the {tokens} tokens, got {starts.tolist()} and "
                                 f"{lengths.tolist()}")


SSM_SCAN = NativeOp(
    "ssm_scan_(Tensor(a!) state, Tensor slots, Tensor has_state, Tensor starts, Tensor lengths, Tensor x, Tensor dt, "
    "Tensor A, Tensor B, Tensor C, Tensor D) -> Tensor",
    library="ssm",
    native="kvloom_ssm_scan(state, slots, has_state, starts, lengths, x, dt, A, B, C, D, Tensor y, int n, "
           "int num_slots, int tokens, int heads, int head_dim, int d_state, int32 num_threads) -> int",
    tensors={"state": TensorSpec(4, _F32), "slots": TensorSpec(1, (torch.int64,)),
             "has_state": TensorSpec(1, (torch.int32,)), "starts": TensorSpec(1, (torch.int64,)),
             "lengths": TensorSpec(1, (torch.int64,)), "x": TensorSpec(3, _F32), "dt": TensorSpec(2, _F32),
             "A": TensorSpec(1, _F32), "B": TensorSpec(3, _F32), "C": TensorSpec(3, _F32), "D": TensorSpec(1, _F32)},
)


@SSM_SCAN.check
def _ssm_scan_check(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor,
                    lengths: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor) -> None:
    _, heads, head_dim, d_state = state.shape
    n, tokens = slots.shape[0], x.shape[0]
    expected = {"has_state": (n,), "starts": (n,), "lengths": (n,), "x": (tokens, heads, head_dim),
                "dt": (tokens, heads), "A": (heads,), "B": (tokens, heads, d_state), "C": (tokens, heads, d_state),
                "D": (heads,)}
    given = {"has_state": has_state, "starts": starts, "lengths": lengths, "x": x, "dt": dt, "A": A, "B": B, "C": C,
             "D": D}
    if head_dim > MAX_HEAD_DIM or d_state > MAX_STATE:
        raise SSM_SCAN.error("state", f"head_dim and d_state must be at most {MAX_HEAD_DIM}, got {head_dim}, "
                                      f"{d_state}")
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise SSM_SCAN.error(name, f"must have shape {list(shape)} (the state's heads {heads}, head_dim "
                                       f"{head_dim}, d_state {d_state}; {n} requests, {tokens} tokens), got "
                                       f"{list(given[name].shape)}")


@SSM_SCAN.implementation
def _ssm_scan_cpu(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor,
                  lengths: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    tokens, heads, head_dim = x.shape
    status = SSM_SCAN.function()(state.data_ptr(), slots.data_ptr(), has_state.data_ptr(), starts.data_ptr(),
                                 lengths.data_ptr(), x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(),
                                 C.data_ptr(), D.data_ptr(), y.data_ptr(), slots.shape[0], state.shape[0], tokens,
                                 heads, head_dim, state.shape[3], torch.get_num_threads())
    _raise_for(SSM_SCAN, status, slots, starts, lengths, state.shape[0], tokens)
    return y


@SSM_SCAN.fake
def _ssm_scan_fake(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor,
                   lengths: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def ssm_scan_(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor,
              lengths: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """The scan of ``n`` requests' chunks (request i's ``lengths[i]`` tokens from row
    ``starts[i]``; int64), token by token from ``state`` [slots, heads, head_dim, d_state]
    at row ``slots[i]`` (int64; zeros where ``has_state[i]``, int32, is 0), which it
    leaves there: x [tokens, heads, head_dim], dt [tokens, heads] (after softplus), A and
    D [heads], B and C [tokens, heads, d_state], all float32. Returns y [tokens, heads,
    head_dim]."""
    return SSM_SCAN.call(state, slots, has_state, starts, lengths, x, dt, A, B, C, D)


# ---- the causal convolution of a flat batch ---------------------------------------------
_VARIANT = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_CONV_KERNEL = 17  # the stored inputs' buffer in ssm.cpp holds 16

CAUSAL_CONV = NativeOp(
    "causal_conv(Tensor xbc, Tensor weight_t, Tensor? bias, Tensor(a!) conv_state, Tensor starts, Tensor lengths, "
    "Tensor slots, Tensor has_state) -> Tensor",
    library="ssm", variants=("f32", "bf16"),
    native="kvloom_causal_conv_{variant}(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state, "
           "Tensor out, int n, int num_slots, int tokens, int channels, int k, int32 num_threads) -> int",
    tensors={"xbc": TensorSpec(2, (torch.float32, torch.bfloat16)), "weight_t": TensorSpec(2, _F32),
             "bias": TensorSpec(1, _F32), "conv_state": TensorSpec(3, like="xbc"),
             "starts": TensorSpec(1, (torch.int64,)), "lengths": TensorSpec(1, (torch.int64,)),
             "slots": TensorSpec(1, (torch.int64,)), "has_state": TensorSpec(1, (torch.int32,))},
)


@CAUSAL_CONV.check
def _causal_conv_check(xbc: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                       conv_state: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                       has_state: torch.Tensor) -> None:
    channels = xbc.shape[1]
    k = weight_t.shape[0]
    if weight_t.shape[1] != channels or not 2 <= k <= MAX_CONV_KERNEL:
        raise CAUSAL_CONV.error("weight_t", f"must be [k, {channels}] with k in [2, {MAX_CONV_KERNEL}], got "
                                            f"{list(weight_t.shape)}")
    if bias is not None and bias.shape[0] != channels:
        raise CAUSAL_CONV.error("bias", f"must hold one value per channel ({channels}), got {bias.shape[0]}")
    if tuple(conv_state.shape[1:]) != (k - 1, channels):
        raise CAUSAL_CONV.error("conv_state", f"must be [slots, {k - 1}, {channels}], got {list(conv_state.shape)}")
    n = slots.shape[0]
    for name, tensor in (("starts", starts), ("lengths", lengths), ("has_state", has_state)):
        if tensor.shape[0] != n:
            raise CAUSAL_CONV.error(name, f"must hold one value per request ({n}, as slots), got {tensor.shape[0]}")


@CAUSAL_CONV.implementation
def _causal_conv_cpu(xbc: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(xbc)
    status = CAUSAL_CONV.function(_VARIANT[xbc.dtype])(
        xbc.data_ptr(), weight_t.data_ptr(), 0 if bias is None else bias.data_ptr(), conv_state.data_ptr(),
        starts.data_ptr(), lengths.data_ptr(), slots.data_ptr(), has_state.data_ptr(), out.data_ptr(),
        slots.shape[0], conv_state.shape[0], xbc.shape[0], xbc.shape[1], weight_t.shape[0], torch.get_num_threads())
    _raise_for(CAUSAL_CONV, status, slots, starts, lengths, conv_state.shape[0], xbc.shape[0])
    return out


@CAUSAL_CONV.fake
def _causal_conv_fake(xbc: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(xbc)


def causal_conv(xbc: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                has_state: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution of ``n`` requests' tokens, ``xbc`` [tokens, channels]
    (float32 or bf16; request i's ``lengths[i]`` tokens from row ``starts[i]``), with
    ``weight_t`` [k, channels] and ``bias`` [channels] (float32), over each request's stored
    inputs in ``conv_state`` [slots, k - 1, channels] (xbc's dtype, oldest first; row ``slots[i]``; zeros
    where ``has_state[i]`` is 0), which it then replaces with the sequence's last k - 1.
    Returns [tokens, channels] in xbc's dtype, before the activation."""
    return CAUSAL_CONV.call(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state)


# ---- LFM2's gated short convolution between its projections, in one call ------------------
SHORT_CONV = NativeOp(
    "short_conv(Tensor proj, Tensor weight_t, Tensor? bias, Tensor(a!) conv_state, Tensor starts, Tensor lengths, "
    "Tensor slots, Tensor has_state) -> Tensor",
    library="ssm", variants=("f32", "bf16"),
    native="kvloom_short_conv_{variant}(proj, weight_t, bias, conv_state, starts, lengths, slots, has_state, "
           "Tensor bx, Tensor out, int n, int num_slots, int tokens, int channels, int k, int32 num_threads) -> int",
    tensors={"proj": TensorSpec(2, (torch.float32, torch.bfloat16)), "weight_t": TensorSpec(2, _F32),
             "bias": TensorSpec(1, _F32), "conv_state": TensorSpec(3, like="proj"),
             "starts": TensorSpec(1, (torch.int64,)), "lengths": TensorSpec(1, (torch.int64,)),
             "slots": TensorSpec(1, (torch.int64,)), "has_state": TensorSpec(1, (torch.int32,))},
)


@SHORT_CONV.check
def _short_conv_check(proj: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> None:
    channels = weight_t.shape[1]
    if proj.shape[1] != 3 * channels:
        raise SHORT_CONV.error("proj", f"must be [tokens, {3 * channels}] (B, C, x of {channels} channels each), got "
                                       f"{list(proj.shape)}")
    _causal_conv_check(proj[:, :channels], weight_t, bias, conv_state, starts, lengths, slots, has_state)


@SHORT_CONV.implementation
def _short_conv_cpu(proj: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                    starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                    has_state: torch.Tensor) -> torch.Tensor:
    tokens, channels = proj.shape[0], weight_t.shape[1]
    bx = torch.empty(tokens, channels, dtype=proj.dtype)
    out = torch.empty(tokens, channels, dtype=proj.dtype)
    status = SHORT_CONV.function(_VARIANT[proj.dtype])(
        proj.data_ptr(), weight_t.data_ptr(), 0 if bias is None else bias.data_ptr(), conv_state.data_ptr(),
        starts.data_ptr(), lengths.data_ptr(), slots.data_ptr(), has_state.data_ptr(), bx.data_ptr(), out.data_ptr(),
        slots.shape[0], conv_state.shape[0], tokens, channels, weight_t.shape[0], torch.get_num_threads())
    _raise_for(SHORT_CONV, status, slots, starts, lengths, conv_state.shape[0], tokens)
    return out


@SHORT_CONV.fake
def _short_conv_fake(proj: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor) -> torch.Tensor:
    return proj.new_empty(proj.shape[0], weight_t.shape[1])


def short_conv(proj: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
               starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
               has_state: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution between its projections: the in_proj output ``proj``
    [tokens, 3 * channels] (B | C | x, float32 or bf16) -> ``C * conv(B * x)`` [tokens,
    channels], each product rounded to proj's dtype; the convolution as ``causal_conv``'s
    (``weight_t``, ``bias``, ``conv_state`` and the requests' spans and slots alike)."""
    return SHORT_CONV.call(proj, weight_t, bias, conv_state, starts, lengths, slots, has_state)


# ---- the mixer between its projections, in one call -----------------------------------
MAMBA_MIXER = NativeOp(
    "mamba_mixer(Tensor proj, Tensor weight_t, Tensor? conv_bias, Tensor(a!) conv_state, Tensor(b!) ssm_state, "
    "Tensor dt_bias, Tensor A_log, Tensor D, Tensor norm_weight, Tensor starts, Tensor lengths, Tensor slots, "
    "Tensor has_state, int groups, float dt_lo, float dt_hi, float eps) -> Tensor",
    library="ssm", variants=("f32", "bf16"),
    native="kvloom_mamba_mixer_{variant}(proj, weight_t, conv_bias, conv_state, ssm_state, dt_bias, A_log, D, "
           "norm_weight, starts, lengths, slots, has_state, Tensor xbc, Tensor y, Tensor out, int n, int num_slots, "
           "int tokens, int inter, int conv_dim, int heads, int head_dim, int d_state, groups, int k, dt_lo, dt_hi, "
           "eps, int32 num_threads) -> int",
    tensors={"proj": TensorSpec(2, (torch.float32, torch.bfloat16)), "weight_t": TensorSpec(2, _F32),
             "conv_bias": TensorSpec(1, _F32), "conv_state": TensorSpec(3, like="proj"),
             "ssm_state": TensorSpec(4, _F32), "dt_bias": TensorSpec(1, _F32), "A_log": TensorSpec(1, _F32),
             "D": TensorSpec(1, _F32), "norm_weight": TensorSpec(1, like="proj"),
             "starts": TensorSpec(1, (torch.int64,)), "lengths": TensorSpec(1, (torch.int64,)),
             "slots": TensorSpec(1, (torch.int64,)), "has_state": TensorSpec(1, (torch.int32,))},
)
@MAMBA_MIXER.check
def _mamba_mixer_check(proj: torch.Tensor, weight_t: torch.Tensor, conv_bias: torch.Tensor | None,
                       conv_state: torch.Tensor, ssm_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                       D: torch.Tensor, norm_weight: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                       slots: torch.Tensor, has_state: torch.Tensor, groups: int, dt_lo: float, dt_hi: float,
                       eps: float) -> None:
    _, heads, head_dim, d_state = ssm_state.shape
    k, conv_dim = weight_t.shape
    inter = norm_weight.shape[0]
    if heads * head_dim != inter or groups <= 0 or heads % groups or conv_dim != inter + 2 * groups * d_state:
        raise MAMBA_MIXER.error("ssm_state", f"[slots, heads, head_dim, d_state] = {list(ssm_state.shape)} must give "
                                             f"heads * head_dim = norm_weight's {inter} features and, with {groups} "
                                             f"groups dividing the heads, the convolution's {conv_dim} channels")
    if head_dim > MAX_HEAD_DIM or d_state > MAX_STATE or not 2 <= k <= MAX_CONV_KERNEL:
        raise MAMBA_MIXER.error("ssm_state", f"head_dim and d_state must be at most {MAX_HEAD_DIM} and the kernel "
                                             f"in [2, {MAX_CONV_KERNEL}], got {head_dim}, {d_state}, {k}")
    if proj.shape[1] != inter + conv_dim + heads:
        raise MAMBA_MIXER.error("proj", f"must be [tokens, {inter + conv_dim + heads}] (z, xBC, dt), got "
                                        f"{list(proj.shape)}")
    if tuple(conv_state.shape[1:]) != (k - 1, conv_dim) or conv_state.shape[0] != ssm_state.shape[0]:
        raise MAMBA_MIXER.error("conv_state", f"must be [{ssm_state.shape[0]}, {k - 1}, {conv_dim}], got "
                                              f"{list(conv_state.shape)}")
    for name, vector, size in (("conv_bias", conv_bias, conv_dim), ("dt_bias", dt_bias, heads),
                               ("A_log", A_log, heads), ("D", D, heads)):
        if vector is not None and vector.shape[0] != size:
            raise MAMBA_MIXER.error(name, f"must hold {size} values, got {vector.shape[0]}")
    n = slots.shape[0]
    for name, tensor in (("starts", starts), ("lengths", lengths), ("has_state", has_state)):
        if tensor.shape[0] != n:
            raise MAMBA_MIXER.error(name, f"must hold one value per request ({n}, as slots), got {tensor.shape[0]}")


@MAMBA_MIXER.implementation
def _mamba_mixer_cpu(proj: torch.Tensor, weight_t: torch.Tensor, conv_bias: torch.Tensor | None,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                     D: torch.Tensor, norm_weight: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                     slots: torch.Tensor, has_state: torch.Tensor, groups: int, dt_lo: float, dt_hi: float,
                     eps: float) -> torch.Tensor:
    tokens, (num_slots, heads, head_dim, d_state), (k, conv_dim) = proj.shape[0], ssm_state.shape, weight_t.shape
    inter = norm_weight.shape[0]
    xbc = torch.empty(tokens, conv_dim, dtype=proj.dtype)
    y = torch.empty(tokens, inter, dtype=torch.float32)
    out = torch.empty(tokens, inter, dtype=proj.dtype)
    status = MAMBA_MIXER.function(_VARIANT[proj.dtype])(
        proj.data_ptr(), weight_t.data_ptr(), 0 if conv_bias is None else conv_bias.data_ptr(), conv_state.data_ptr(),
        ssm_state.data_ptr(), dt_bias.data_ptr(), A_log.data_ptr(), D.data_ptr(), norm_weight.data_ptr(),
        starts.data_ptr(), lengths.data_ptr(), slots.data_ptr(), has_state.data_ptr(), xbc.data_ptr(), y.data_ptr(),
        out.data_ptr(), slots.shape[0], num_slots, tokens, inter, conv_dim, heads, head_dim, d_state, groups, k,
        dt_lo, dt_hi, eps, torch.get_num_threads())
    _raise_for(MAMBA_MIXER, status, slots, starts, lengths, num_slots, tokens)
    return out


@MAMBA_MIXER.fake
def _mamba_mixer_fake(proj: torch.Tensor, weight_t: torch.Tensor, conv_bias: torch.Tensor | None,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                      D: torch.Tensor, norm_weight: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                      slots: torch.Tensor, has_state: torch.Tensor, groups: int, dt_lo: float, dt_hi: float,
                      eps: float) -> torch.Tensor:
    return proj.new_empty(proj.shape[0], norm_weight.shape[0])


def mamba_mixer(proj: torch.Tensor, weight_t: torch.Tensor, conv_bias: torch.Tensor | None, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                norm_weight: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                has_state: torch.Tensor, groups: int, dt_lo: float, dt_hi: float, eps: float) -> torch.Tensor:
    """A Mamba2 mixer between its projections: ``proj`` [tokens, inter + conv_dim + heads]
    (the in_proj output: z, xBC, dt; float32 or bf16) -> the gated norm's output [tokens,
    inter] in proj's dtype, for out_proj. The causal convolution (``weight_t`` [k,
    conv_dim], ``conv_bias``, float32) over and into ``conv_state`` [slots, k - 1, conv_dim]
    (proj's dtype) and silu; the scan of x, B, C (``groups`` of them) and softplus(dt +
    ``dt_bias``) clamped to [dt_lo, dt_hi], with A = -exp(``A_log``) and ``D`` (float32),
    over and into ``ssm_state`` [slots, heads, head_dim, d_state] (float32); the gated RMSNorm
    by groups (``norm_weight`` [inter], proj's dtype; ``eps``). The requests' spans and slots
    as ``ssm_scan_``'s."""
    return MAMBA_MIXER.call(proj, weight_t, conv_bias, conv_state, ssm_state, dt_bias, A_log, D, norm_weight, starts,
                            lengths, slots, has_state, groups, dt_lo, dt_hi, eps)
