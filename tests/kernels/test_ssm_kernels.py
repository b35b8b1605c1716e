"""Mamba2's decode kernel (kvloom/csrc/ssm.cpp) against its pure-PyTorch reference
(models/ssm_ops.selective_state_update): the outputs and the states left in the slots
agree to float32 rounding, for requests in any slots, some from a zero state (their old
slot contents unread); slots no request names are not touched; a request's bits do not
depend on the batch; a slot outside the state is refused by name. The model-level
tests (Mamba2, Bamba, Granite 4.0 against transformers) run it on every decode step."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import ssm
from kvloom.models import ssm_ops

pytestmark = pytest.mark.skipif(not ssm.available(), reason="ssm.cpp does not build here")


def inputs(n: int, heads: int, head_dim: int, d_state: int, slots: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(slots, heads, head_dim, d_state, generator=g),
            "x": torch.randn(n, heads, head_dim, generator=g),
            "dt": torch.nn.functional.softplus(torch.randn(n, heads, generator=g)),
            "A": -torch.rand(heads, generator=g) * 4, "B": torch.randn(n, heads, d_state, generator=g),
            "C": torch.randn(n, heads, d_state, generator=g), "D": torch.randn(heads, generator=g)}


@pytest.mark.parametrize(("heads", "head_dim", "d_state"), [(2, 4, 8), (18, 64, 64), (3, 16, 100)])
def test_the_kernel_is_the_reference(heads: int, head_dim: int, d_state: int) -> None:
    t = inputs(5, heads, head_dim, d_state, slots=8)
    slots = torch.tensor([6, 1, 3, 0, 7])
    has_state = torch.tensor([True, False, True, True, False])
    expected_state = t["state"].clone()
    start = expected_state[slots].masked_fill(~has_state[:, None, None, None], 0)
    y_ref, new = ssm_ops.selective_state_update(start, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])
    expected_state[slots] = new
    state = t["state"].clone()
    state[slots[~has_state]] = float("nan")  # a fresh request's old slot is never read
    expected_state[slots[~has_state]] = new[~has_state]
    y = ssm.ssm_decode_(state, slots, has_state.to(torch.int32), t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-6, atol=1e-6)
    untouched = torch.tensor([2, 4, 5])
    assert torch.equal(state[untouched], t["state"][untouched])


def test_a_requests_bits_do_not_depend_on_its_batch() -> None:
    t = inputs(6, 18, 64, 64, slots=6, seed=1)
    everyone = torch.arange(6)
    has_state = torch.ones(6, dtype=torch.int32)
    together = t["state"].clone()
    y_together = ssm.ssm_decode_(together, everyone, has_state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])
    for i in range(6):
        alone = t["state"].clone()
        y_alone = ssm.ssm_decode_(alone, everyone[i:i + 1], has_state[i:i + 1], t["x"][i:i + 1], t["dt"][i:i + 1],
                                  t["A"], t["B"][i:i + 1], t["C"][i:i + 1], t["D"])
        assert torch.equal(y_alone[0], y_together[i]) and torch.equal(alone[i], together[i])


def test_the_models_decode_step_takes_the_kernel_and_the_reference_alike() -> None:
    """ssm_ops.decode_update_ on a float32 CPU state runs the kernel; on a float64 state
    (which it does not take) the reference: the two agree."""
    t = inputs(4, 4, 8, 16, slots=5, seed=2)
    slots, has_state = torch.tensor([4, 0, 2, 1]), torch.tensor([True, True, False, True])
    native_state = t["state"].clone()
    y = ssm_ops.decode_update_(native_state, slots, has_state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"])
    ref_state = t["state"].double()
    y_ref = ssm_ops.decode_update_(ref_state, slots, has_state, *(t[k].double() for k in ("x", "dt", "A", "B", "C",
                                                                                         "D")))
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_state, ref_state.float(), rtol=1e-5, atol=1e-5)


def test_a_slot_outside_the_state_is_refused() -> None:
    t = inputs(2, 2, 4, 8, slots=3)
    with pytest.raises(ValueError, match=r"kvloom::ssm_decode_: slots must lie in \[0, 3\), got \[0, 3\]"):
        ssm.ssm_decode_(t["state"], torch.tensor([0, 3]), torch.ones(2, dtype=torch.int32), t["x"], t["dt"],
                        t["A"], t["B"], t["C"], t["D"])
