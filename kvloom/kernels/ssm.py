"""Mamba2's decode step (kvloom/csrc/ssm.cpp): ``kvloom::ssm_decode_``, one recurrent step
of the selective scan for a batch of requests, their float32 SSM states updated in place
in their state slots. models/ssm_ops.py calls it on CPU and keeps the pure-PyTorch
reference (``selective_state_update``, the oracle in tests/kernels/test_ssm_kernels.py,
and what runs where this source does not build or the state is not float32 on a CPU)."""

from __future__ import annotations

import torch

from kvloom.kernels.native_op import NativeOp, TensorSpec

_F32 = (torch.float32,)


def available() -> bool:
    """Whether ssm.cpp builds here."""
    return SSM_DECODE.available()


SSM_DECODE = NativeOp(
    "ssm_decode_(Tensor(a!) state, Tensor slots, Tensor has_state, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor D) -> Tensor",
    library="ssm",
    native="kvloom_ssm_decode(state, slots, has_state, x, dt, A, B, C, D, Tensor y, int n, int heads, int head_dim, "
           "int d_state, int32 num_threads) -> ()",
    tensors={"state": TensorSpec(4, _F32), "slots": TensorSpec(1, (torch.int64,)),
             "has_state": TensorSpec(1, (torch.int32,)), "x": TensorSpec(3, _F32), "dt": TensorSpec(2, _F32),
             "A": TensorSpec(1, _F32), "B": TensorSpec(3, _F32), "C": TensorSpec(3, _F32), "D": TensorSpec(1, _F32)},
)


@SSM_DECODE.check
def _ssm_decode_check(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor,
                      dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> None:
    _, heads, head_dim, d_state = state.shape
    n = slots.shape[0]
    expected = {"has_state": (n,), "x": (n, heads, head_dim), "dt": (n, heads), "A": (heads,),
                "B": (n, heads, d_state), "C": (n, heads, d_state), "D": (heads,)}
    given = {"has_state": has_state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise SSM_DECODE.error(name, f"must have shape {list(shape)} (the state's heads {heads}, head_dim "
                                         f"{head_dim}, d_state {d_state}; {n} requests), got "
                                         f"{list(given[name].shape)}")


@SSM_DECODE.implementation
def _ssm_decode_cpu(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor,
                    dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor) -> torch.Tensor:
    # The slots' values are data, which a fake tensor does not have: checked here, where they are.
    if slots.shape[0] and not (0 <= int(slots.min()) and int(slots.max()) < state.shape[0]):
        raise SSM_DECODE.error("slots", f"must lie in [0, {state.shape[0]}), got {slots.tolist()}")
    y = torch.empty_like(x)
    n, heads, head_dim = x.shape
    SSM_DECODE.function()(state.data_ptr(), slots.data_ptr(), has_state.data_ptr(), x.data_ptr(), dt.data_ptr(),
                          A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), y.data_ptr(), n, heads, head_dim,
                          state.shape[3], torch.get_num_threads())
    return y


@SSM_DECODE.fake
def _ssm_decode_fake(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor,
                     dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def ssm_decode_(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor,
                dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """One token of each of ``n`` requests: ``state`` [slots, heads, head_dim, d_state]
    updated in place at rows ``slots`` [n] (int64; a request with ``has_state`` [n] int32
    0 starts from zeros), x [n, heads, head_dim], dt [n, heads] (after softplus), A and D
    [heads], B and C [n, heads, d_state], all float32. Returns y [n, heads, head_dim]."""
    return SSM_DECODE.call(state, slots, has_state, x, dt, A, B, C, D)
