"""The one-pass random draw (kvloom/csrc/sampling.cpp) as ``kvloom::sample_rows``.

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
