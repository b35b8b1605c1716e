"""Mamba2's mixer on a CPU (kvloom/csrc/ssm.cpp): ``kvloom::ssm_scan_``, the selective
scan of a flat batch (prompts' chunks and decodes alike), each request's float32 SSM state
updated in place in its state slot, and ``kvloom::causal_conv``, the depthwise causal convolution
of a flat batch over and into the slots' stored inputs. models/ssm_ops.py calls them on CPU
and keeps the pure-PyTorch references (``sequential_scan`` and ``causal_conv``, the
oracles in tests/kernels/test_ssm_kernels.py, and what runs where this source does not
build or the tensors are not the kernels')."""

from __future__ import annotations

import torch

from kvloom.kernels.native_op import NativeOp, TensorSpec

_F32 = (torch.float32,)


def available() -> bool:
    """Whether ssm.cpp builds here."""
    return SSM_SCAN.available()


SSM_SCAN = NativeOp(
    "ssm_scan_(Tensor(a!) state, Tensor slots, Tensor has_state, Tensor starts, Tensor lengths, Tensor x, Tensor dt, "
    "Tensor A, Tensor B, Tensor C, Tensor D) -> Tensor",
    library="ssm",
    native="kvloom_ssm_scan(state, slots, has_state, starts, lengths, x, dt, A, B, C, D, Tensor y, int n, int heads, "
           "int head_dim, int d_state, int32 num_threads) -> ()",
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
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise SSM_SCAN.error(name, f"must have shape {list(shape)} (the state's heads {heads}, head_dim "
                                       f"{head_dim}, d_state {d_state}; {n} requests, {tokens} tokens), got "
                                       f"{list(given[name].shape)}")


@SSM_SCAN.implementation
def _ssm_scan_cpu(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, starts: torch.Tensor,
                  lengths: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    # The values are data, which a fake tensor does not have: checked here, where they are.
    if slots.shape[0]:
        if not (0 <= int(slots.min()) and int(slots.max()) < state.shape[0]):
            raise SSM_SCAN.error("slots", f"must lie in [0, {state.shape[0]}), got {slots.tolist()}")
        if int(starts.min()) < 0 or int(lengths.min()) < 0 or int((starts + lengths).max()) > x.shape[0]:
            raise SSM_SCAN.error("starts", f"and lengths must name spans of the {x.shape[0]} tokens, got "
                                           f"{starts.tolist()} and {lengths.tolist()}")
    y = torch.empty_like(x)
    _, heads, head_dim = x.shape
    SSM_SCAN.function()(state.data_ptr(), slots.data_ptr(), has_state.data_ptr(), starts.data_ptr(),
                        lengths.data_ptr(), x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                        D.data_ptr(), y.data_ptr(), slots.shape[0], heads, head_dim, state.shape[3],
                        torch.get_num_threads())
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
           "Tensor out, int n, int channels, int k, int32 num_threads) -> ()",
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
    if tuple(conv_state.shape[1:]) != (channels, k - 1):
        raise CAUSAL_CONV.error("conv_state", f"must be [slots, {channels}, {k - 1}], got {list(conv_state.shape)}")
    n = slots.shape[0]
    for name, tensor in (("starts", starts), ("lengths", lengths), ("has_state", has_state)):
        if tensor.shape[0] != n:
            raise CAUSAL_CONV.error(name, f"must hold one value per request ({n}, as slots), got {tensor.shape[0]}")


@CAUSAL_CONV.implementation
def _causal_conv_cpu(xbc: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor) -> torch.Tensor:
    # The values are data, which a fake tensor does not have: checked here, where they are.
    if slots.shape[0]:
        if not (0 <= int(slots.min()) and int(slots.max()) < conv_state.shape[0]):
            raise CAUSAL_CONV.error("slots", f"must lie in [0, {conv_state.shape[0]}), got {slots.tolist()}")
        if int(starts.min()) < 0 or int(lengths.min()) < 0 or int((starts + lengths).max()) > xbc.shape[0]:
            raise CAUSAL_CONV.error("starts", f"and lengths must name spans of the {xbc.shape[0]} tokens, got "
                                              f"{starts.tolist()} and {lengths.tolist()}")
    out = torch.empty_like(xbc)
    CAUSAL_CONV.function(_VARIANT[xbc.dtype])(
        xbc.data_ptr(), weight_t.data_ptr(), 0 if bias is None else bias.data_ptr(), conv_state.data_ptr(),
        starts.data_ptr(), lengths.data_ptr(), slots.data_ptr(), has_state.data_ptr(), out.data_ptr(),
        slots.shape[0], xbc.shape[1], weight_t.shape[0], torch.get_num_threads())
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
    inputs in ``conv_state`` [slots, channels, k - 1] (xbc's dtype; row ``slots[i]``; zeros
    where ``has_state[i]`` is 0), which it then replaces with the sequence's last k - 1.
    Returns [tokens, channels] in xbc's dtype, before the activation."""
    return CAUSAL_CONV.call(xbc, weight_t, bias, conv_state, starts, lengths, slots, has_state)
