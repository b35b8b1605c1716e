"""The sampler's kernels (kvloom/csrc/sampling.cpp): the one-pass random draw
``kvloom::sample_rows``, the greedy ``argmax_rows`` and structured output's
``apply_token_bitmask_``.

Row r draws the first token whose running sum of exp((logits - max) * inv_temperature[r])
exceeds uniforms[r] times the total: the inverse-CDF rule of runner/sampler.py's
``Sampler._inverse_cdf``, in one pass per row instead of PyTorch's chain of full
[rows, vocab] passes. -inf entries weigh exactly zero and are never drawn.
"""

from __future__ import annotations

import torch

from kvloom.kernels.native_op import NativeOp, TensorSpec

_FLOAT32 = (torch.float32,)


def available() -> bool:
    """Whether sampling.cpp builds here."""
    return SAMPLE_ROWS.available()


SAMPLE_ROWS = NativeOp(
    "sample_rows(Tensor logits, Tensor inv_temp, Tensor uniforms) -> Tensor",
    library="sampling",
    native="kvloom_sample_rows(logits, int rows, int vocab, inv_temp, uniforms, Tensor out, int32 num_threads) -> ()",
    tensors={"logits": TensorSpec(2, _FLOAT32), "inv_temp": TensorSpec(1, _FLOAT32),
             "uniforms": TensorSpec(1, _FLOAT32)},
)


@SAMPLE_ROWS.check
def _sample_rows_check(logits: torch.Tensor, inv_temp: torch.Tensor, uniforms: torch.Tensor) -> None:
    rows = logits.shape[0]
    if logits.shape[1] == 0:  # nothing to sample (the kernel would return token 0, which is not there)
        raise SAMPLE_ROWS.error("logits", "must have at least one column")
    for name, values in (("inv_temp", inv_temp), ("uniforms", uniforms)):
        if values.shape[0] != rows:
            raise SAMPLE_ROWS.error(name, f"must have one value per row of logits ({rows}), got {values.shape[0]}")


@SAMPLE_ROWS.implementation
def _sample_rows_cpu(logits: torch.Tensor, inv_temp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)  # [rows]
    SAMPLE_ROWS.function()(logits.data_ptr(), rows, vocab, inv_temp.data_ptr(), uniforms.data_ptr(),
                           tokens.data_ptr(), torch.get_num_threads())
    return tokens


@SAMPLE_ROWS.fake
def _sample_rows_fake(logits: torch.Tensor, inv_temp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample_rows(logits: torch.Tensor, inv_temp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of logits: [rows, vocab] float32, with inv_temp and uniforms:
    [rows] float32 (all contiguous). Returns [rows] int64."""
    return SAMPLE_ROWS.call(logits, inv_temp, uniforms)


# ---- greedy: the first maximum of each row --------------------------------------------
ARGMAX_ROWS = NativeOp(
    "argmax_rows(Tensor logits) -> Tensor",
    library="sampling",
    native="kvloom_argmax_rows(logits, int32 dtype, int rows, int vocab, Tensor out, int32 num_threads) -> ()",
    tensors={"logits": TensorSpec(2, (torch.float32, torch.bfloat16))},
)


@ARGMAX_ROWS.check
def _argmax_rows_check(logits: torch.Tensor) -> None:
    if logits.shape[1] == 0:
        raise ARGMAX_ROWS.error("logits", "must have at least one column")


@ARGMAX_ROWS.implementation
def _argmax_rows_cpu(logits: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)  # [rows]
    ARGMAX_ROWS.function()(logits.data_ptr(), 0 if logits.dtype == torch.float32 else 1, rows, vocab,
                           tokens.data_ptr(), torch.get_num_threads())
    return tokens


@ARGMAX_ROWS.fake
def _argmax_rows_fake(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [rows, vocab] float32 or bf16 logits (contiguous),
    read once as they are: no float32 copy, and several times faster than torch's
    argmax on these CPUs. Returns [rows] int64; ties and NaN as torch.argmax."""
    return ARGMAX_ROWS.call(logits)


# ---- structured output: forbid what each constrained row's grammar does not allow -------
APPLY_TOKEN_BITMASK = NativeOp(
    "apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()",
    library="sampling",
    native="kvloom_apply_token_bitmask(logits, int32 dtype, int vocab, rows, bitmask, int count, int width, "
           "int32 num_threads) -> ()",
    tensors={"logits": TensorSpec(2, (torch.float32, torch.bfloat16)), "rows": TensorSpec(1, (torch.int64,)),
             "bitmask": TensorSpec(2, (torch.int32,))},
)


@APPLY_TOKEN_BITMASK.check
def _apply_token_bitmask_check(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if bitmask.shape[0] != rows.shape[0]:
        raise APPLY_TOKEN_BITMASK.error("rows", f"must name one row of logits per bitmask row ({bitmask.shape[0]}), "
                                                f"got {rows.shape[0]}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise APPLY_TOKEN_BITMASK.error("bitmask", f"must hold a bit per token ({logits.shape[1]}), got "
                                                   f"{bitmask.shape[1]} words")


@APPLY_TOKEN_BITMASK.implementation
def _apply_token_bitmask_cpu(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    # The rows' values are data, which a fake tensor does not have: checked here, where they are.
    if rows.shape[0] and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        raise APPLY_TOKEN_BITMASK.error("rows", f"must lie in [0, {logits.shape[0]}), got {rows.tolist()}")
    APPLY_TOKEN_BITMASK.function()(logits.data_ptr(), 0 if logits.dtype == torch.float32 else 1, logits.shape[1],
                                   rows.data_ptr(), bitmask.data_ptr(), bitmask.shape[0], bitmask.shape[1],
                                   torch.get_num_threads())


@APPLY_TOKEN_BITMASK.fake
def _apply_token_bitmask_fake(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    return None


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf at every token of row ``rows[c]`` of ``logits`` ([batch, vocab]
    float32 or bf16) whose bit in ``bitmask[c]`` ([count, ceil(vocab / 32)] int32; bit b
    of word w for token 32 * w + b) is clear. The reference is runner/sampler.py's
    PyTorch ``apply_token_bitmask`` (tests/kernels/test_sampling_kernels.py)."""
    APPLY_TOKEN_BITMASK.call(logits, rows, bitmask)
