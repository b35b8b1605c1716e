"""The Mamba2 mixer's arithmetic (models/ssm_ops.py): the chunked SSD scan against the
sequential reference, a scan split in two against one pass, and the stateful causal
convolution against torch's conv1d over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.batch import ForwardBatch
from kvloom.models import ssm_ops


def scan_inputs(length: int, heads: int = 4, head_dim: int = 3, d_state: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(length, heads, generator=g, dtype=torch.float64))
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    B = torch.randn(length, heads, d_state, generator=g, dtype=torch.float64)
    C = torch.randn(length, heads, d_state, generator=g, dtype=torch.float64)
    D = torch.randn(heads, generator=g, dtype=torch.float64)
    state = torch.randn(heads, head_dim, d_state, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, D, state


@pytest.mark.parametrize("length, chunk_size", [(1, 4), (7, 4), (8, 4), (13, 8), (20, 3)])
@pytest.mark.parametrize("zero_state", [False, True])
def test_ssd_scan_equals_the_sequential_scan(length: int, chunk_size: int, zero_state: bool) -> None:
    x, dt, A, B, C, D, state = scan_inputs(length)
    if zero_state:
        state = torch.zeros_like(state)
    y_ref, final_ref = ssm_ops.sequential_scan(x, dt, A, B, C, D, state)
    y, final = ssm_ops.ssd_scan(x, dt, A, B, C, D, state, chunk_size)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scan", ["sequential", "ssd"])
def test_a_scan_in_two_chunks_continues_from_the_stored_state(scan: str) -> None:
    x, dt, A, B, C, D, state = scan_inputs(17, seed=3)

    def run(lo: int, hi: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args = (x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, initial)
        return ssm_ops.ssd_scan(*args, 4) if scan == "ssd" else ssm_ops.sequential_scan(*args)

    whole, final = run(0, 17, state)
    first, middle = run(0, 6, state)
    second, end = run(6, 17, middle)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end, final, rtol=1e-10, atol=1e-10)


def batch_of(query_lens: list[int], seq_lens: list[int], slots: list[int]) -> ForwardBatch:
    """A ForwardBatch with what the mixers read: lengths and state slots."""
    num_tokens = sum(query_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64), positions=torch.zeros(num_tokens, dtype=torch.int64),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        block_tables=torch.zeros(len(slots), 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64), query_lens_list=query_lens, seq_lens_list=seq_lens,
        block_size=16, state_slots=torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("conv", [ssm_ops.causal_conv, ssm_ops.causal_conv_reference], ids=["native", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_in_steps_equals_conv1d_over_each_whole_sequence(conv, dtype: torch.dtype) -> None:
    """Two requests in a mixed batch: one prefilled in chunks of 5, 1, 3 tokens, the
    other decoding one token at a time after a 2-token prompt (shorter than the kernel).
    In bf16 the inputs are bf16 numbers and the output is float32's rounded once."""
    channels, kernel = 6, 4
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(channels, kernel, generator=g), torch.randn(channels, generator=g)
    seqs = {0: torch.randn(9, channels, generator=g).to(dtype), 1: torch.randn(6, channels, generator=g).to(dtype)}
    conv_state = torch.full((3, kernel - 1, channels), 7.0, dtype=dtype)  # stale state of an earlier owner
    slots = {0: 2, 1: 0}
    chunks = [{0: 5, 1: 2}, {0: 1, 1: 1}, {0: 3, 1: 1}, {1: 1}, {1: 1}]
    done = {0: 0, 1: 0}
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in chunks:
        order = list(step)
        batch = batch_of([step[r] for r in order], [done[r] + step[r] for r in order], [slots[r] for r in order])
        xbc = torch.cat([seqs[r][done[r]:done[r] + step[r]] for r in order])
        params = ssm_ops.ConvParams(weight.t().contiguous(), bias)
        out = conv(xbc, params, conv_state, ssm_ops.SSMSpans.of(batch, kernel))
        assert out.dtype == dtype
        for r, piece in zip(order, out.split([step[r] for r in order]), strict=True):
            outputs[r].append(piece)
            done[r] += step[r]
    for r, seq in seqs.items():
        expected = F.conv1d(seq.float().t()[None], weight[:, None, :], bias, padding=kernel - 1, groups=channels)
        torch.testing.assert_close(torch.cat(outputs[r]), expected[0, :, :seq.shape[0]].t().to(dtype),
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
        # The slot holds the last k - 1 inputs.
        torch.testing.assert_close(conv_state[slots[r]], seq[-(kernel - 1):])


def test_spans_need_a_slot_for_every_request() -> None:
    batch = batch_of([2, 1], [2, 5], [0, 1])
    batch.state_slots = None
    with pytest.raises(ValueError, match="state slot"):
        ssm_ops.SSMSpans.of(batch, 4)


def test_the_in_place_decode_update_is_the_reference() -> None:
    """selective_state_update_ (the decode path: the state updated in place) against
    selective_state_update (the reference), float64."""
    from kvloom.models.ssm_ops import selective_state_update, selective_state_update_
    g = torch.Generator().manual_seed(5)
    n, heads, head_dim, d_state = 3, 4, 5, 6
    state = torch.randn(n, heads, head_dim, d_state, generator=g, dtype=torch.float64)
    x = torch.randn(n, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(n, heads, generator=g, dtype=torch.float64)
    A, D = -torch.rand(heads, generator=g, dtype=torch.float64), torch.randn(heads, generator=g, dtype=torch.float64)
    B, C = (torch.randn(n, heads, d_state, generator=g, dtype=torch.float64) for _ in range(2))
    expected_y, expected_state = selective_state_update(state, x, dt, A, B, C, D)
    updated = state.clone()
    y = selective_state_update_(updated, x, dt, A, B, C, D)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(updated, expected_state)
