"""Every native op ``kvloom::*`` (kernels/native_op.py): a wrong call raises a ValueError
that names the op and the argument (through torch.ops and through the direct path
alike), ``torch.library.opcheck`` passes (schema and mutation marks, fake tensors,
compilation), each declaration matches the C prototype in kvloom/csrc, and the
kernels layer imports nothing above it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvloom import native
from kvloom.kernels import (  # noqa: F401 (declares its op)
    cpu_ops,
    decoder_stack,
    gemm,
    latent_attention,
    mxfp4,
    native_op,
    paged_attention,
    sampling,
    ssm,
)

OPS = native_op.OPS
ISA = gemm.supported_isas()[0] if gemm.supported_isas() else "avx2"
PAIRED = paged_attention.available() and paged_attention.paired_layout(64, 16)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def attention_args(dtype: torch.dtype, paired: bool, sinks: bool = False) -> tuple[Any, ...]:
    """Two sequences over 16-token blocks: a 3-token chunk after 17 cached tokens, and a
    5-token fresh prefill. 4 heads on 2 kv heads of 64 dims; ``sinks``: with a sink per head."""
    kv_cache = randn(2, 4, 16, 2, 64, dtype=dtype, seed=1)
    block_tables = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    query_start = torch.tensor([0, 3], dtype=torch.int32)
    query_lens = torch.tensor([3, 5], dtype=torch.int32)
    q = randn(8, 4, 64, dtype=dtype, seed=2)
    return (q, kv_cache, block_tables, seq_lens, query_start, query_lens, 0.125, paired, 0, 0.0,
            randn(4, seed=3) if sinks else None)


def latent_attention_args(dtype: torch.dtype) -> tuple[Any, ...]:
    """attention_args's two sequences over one layer's latents: 3 heads of 40 (32 of value)."""
    cache = randn(1, 4, 16, 1, 40, dtype=dtype, seed=1)
    q, _, block_tables, seq_lens, query_start, query_lens, *_ = attention_args(dtype, False)
    return (randn(8, 3, 40, dtype=dtype, seed=2), cache, block_tables, seq_lens, query_start, query_lens, 32, 0.2,
            "float32")


def gemm_args() -> tuple[Any, ...]:
    weight, bias = randn(20, 8, dtype=torch.bfloat16, seed=3), randn(20, dtype=torch.bfloat16, seed=4)
    return randn(4, 8, dtype=torch.bfloat16, seed=5), gemm.pack_weight(weight), bias, 20, ISA


def gemm_grouped_args() -> tuple[Any, ...]:
    """Three weights of [20, 8]; rows 0-2 the first's, none the second's, 3-4 the third's."""
    packed, = gemm.pack_weight_groups([[randn(20, 8, dtype=torch.bfloat16, seed=seed) for seed in (3, 4, 5)]])
    return randn(5, 8, dtype=torch.bfloat16, seed=6), packed, torch.tensor([0, 3, 3, 5]), 20, ISA


def moe_combine_args(dtype: torch.dtype) -> tuple[Any, ...]:
    """Four rows of expert outputs for three tokens of two choices each (the last has one)."""
    return randn(4, 24, dtype=dtype, seed=7), torch.rand(4), torch.tensor([[0, 2], [1, 3], [-1, 2]])


def mxfp4_args(dtype: torch.dtype, bias: bool = True) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (20, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(120, 130, (20, 2), generator=generator, dtype=torch.uint8)
    return (randn(4, 64, dtype=dtype, seed=10), blocks, scales, randn(20, dtype=dtype, seed=11) if bias else None,
            mxfp4.default_isa())


def ssm_scan_args() -> tuple[Any, ...]:
    """Three requests in slots 3, 0 and 2 of 4 (the second from a zero state), chunks of 2,
    1 and 1 tokens: 2 heads of 4 dims, a state of 8."""
    return (randn(4, 2, 4, 8, seed=12), torch.tensor([3, 0, 2]), torch.tensor([1, 0, 1], dtype=torch.int32),
            torch.tensor([0, 2, 3]), torch.tensor([2, 1, 1]), randn(4, 2, 4, seed=13), randn(4, 2, seed=14).abs(),
            -randn(2, seed=15).abs(), randn(4, 2, 8, seed=16), randn(4, 2, 8, seed=17), randn(2, seed=18))


def causal_conv_args(dtype: torch.dtype, bias: bool = True) -> tuple[Any, ...]:
    """Two requests of 3 and 1 tokens in slots 2 and 0 of 3 (the first from a zero state),
    6 channels, a 4-tap kernel."""
    return (randn(4, 6, dtype=dtype, seed=19), randn(4, 6, seed=20), randn(6, seed=21) if bias else None,
            randn(3, 3, 6, dtype=dtype, seed=22), torch.tensor([0, 3]), torch.tensor([3, 1]), torch.tensor([2, 0]),
            torch.tensor([0, 1], dtype=torch.int32))


def short_conv_args(dtype: torch.dtype, bias: bool = True) -> tuple[Any, ...]:
    """causal_conv_args's requests and kernel over an in_proj output of B, C and x (6 channels each)."""
    xbc, weight_t, conv_bias, conv_state, *spans = causal_conv_args(dtype, bias)
    return (randn(4, 18, dtype=dtype, seed=32), weight_t, conv_bias, conv_state, *spans)


def mamba_mixer_args(dtype: torch.dtype) -> tuple[Any, ...]:
    """Two requests of 2 and 1 tokens in slots 1 and 0 of 2 (the second from a zero state):
    4 heads of 4 dims in 2 groups, a state of 8, a 4-tap convolution (16 + 32 channels)."""
    return (randn(3, 16 + 48 + 4, dtype=dtype, seed=23), randn(4, 48, seed=24), randn(48, seed=25),
            randn(2, 3, 48, dtype=dtype, seed=26), randn(2, 4, 4, 8, seed=27), randn(4, seed=28), randn(4, seed=29),
            randn(4, seed=30), randn(16, dtype=dtype, seed=31), torch.tensor([0, 2]), torch.tensor([2, 1]),
            torch.tensor([1, 0]), torch.tensor([1, 0], dtype=torch.int32), 2, 0.0, float("inf"), 1e-5)


def rotary_args(dtype: torch.dtype) -> tuple[Any, ...]:
    # Rows strided (the fused qkv output: q and k are a prefix of each row) are welcome.
    qkv = randn(5, 200, dtype=dtype, seed=6)[:, :128]
    return qkv, 6, 16, randn(5, 16, seed=7), randn(5, 16, seed=8)


# op name -> calls with valid arguments (each a fresh tuple: some ops write their inputs)
# (the first of each is the one RELATIONS changes)
EXAMPLES: dict[str, list[Callable[[], tuple[Any, ...]]]] = {
    "rms_norm": [lambda: (randn(5, 64, dtype=torch.bfloat16), randn(5, 64, dtype=torch.bfloat16, seed=2),
                          randn(64, dtype=torch.bfloat16, seed=1), 1e-6),
                 lambda: (randn(5, 64), None, randn(64, seed=1), 1e-5)],
    "rms_norm_scaled": [lambda: (randn(5, 64, dtype=torch.bfloat16), randn(5, 64, dtype=torch.bfloat16, seed=2),
                                 randn(64, dtype=torch.bfloat16, seed=1), 1e-6, 1.0),
                        lambda: (randn(5, 64), None, randn(64, seed=1), 1e-5, 0.0)],
    "layer_norm": [lambda: (randn(5, 64, dtype=torch.bfloat16), randn(5, 64, dtype=torch.bfloat16, seed=2),
                            randn(64, dtype=torch.bfloat16, seed=1), randn(64, dtype=torch.bfloat16, seed=3), 1e-5),
                   lambda: (randn(5, 64), None, randn(64, seed=1), randn(64, seed=3), 1e-5)],
    "silu_and_mul": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "gelu_tanh": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "gelu_erf": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "relu": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "relu2": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "clamp_": [lambda: (randn(5, 32), 0.5), lambda: (randn(3, 64, dtype=torch.bfloat16), 0.25)],
    "gelu_tanh_and_mul": [lambda: (randn(5, 32),), lambda: (randn(3, 64, dtype=torch.bfloat16),)],
    "rotary_": [lambda: rotary_args(torch.float32), lambda: rotary_args(torch.bfloat16)],
    "paged_attention": [lambda: attention_args(torch.float32, False), lambda: attention_args(torch.bfloat16, False),
                        lambda: attention_args(torch.float32, False, sinks=True)]
                       + ([lambda: attention_args(torch.bfloat16, True),
                           lambda: attention_args(torch.bfloat16, True, sinks=True)] if PAIRED else []),
    "latent_attention": [lambda: latent_attention_args(torch.bfloat16), lambda: latent_attention_args(torch.float32)],
    "latent_rotary": [lambda: (randn(5, 3, 8, dtype=torch.bfloat16), randn(5, 8, seed=1), randn(5, 8, seed=2), True),
                      lambda: (randn(2, 1, 6), randn(2, 6, seed=1), randn(2, 6, seed=2), False)],
    "write_kv_paired": [lambda: (randn(6, 2, 64, dtype=torch.bfloat16), randn(6, 2, 64, dtype=torch.bfloat16, seed=1),
                                 torch.tensor([0, 17, 3, 40, 63, 20]),
                                 torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16))],
    "sample_rows": [lambda: (randn(4, 50) * 3, torch.rand(4) + 0.5, torch.rand(4))],
    "argmax_rows": [lambda: (randn(4, 50),), lambda: (randn(3, 70, dtype=torch.bfloat16),)],
    "gemm_pack": [lambda: (randn(20, 8, dtype=torch.bfloat16),)],
    "gemm_bf16": [gemm_args],
    "gemm_grouped_bf16": [gemm_grouped_args],
    "moe_route": [lambda: (randn(5, 12, dtype=torch.bfloat16, seed=8), None, 3, 0, 1, 0.0, 1.0, 0, 1, 1, 0),
                  lambda: (randn(2, 6, seed=9), randn(6, seed=10), 6, 1, 0, 1e-6, 2.5, 1, 1, 1, 0),
                  lambda: (randn(4, 12, seed=17), randn(12, seed=18), 3, 1, 1, 1e-6, 2.5, 0, 4, 2, 2),
                  lambda: (randn(3, 12, dtype=torch.bfloat16, seed=19), None, 2, 0, 0, 0.0, 1.5, 0, 3, 1, 1)],
    "router_logits": [lambda: (randn(5, 40, dtype=torch.bfloat16, seed=15), randn(7, 40, seed=16))],
    "sigmoid_gate_": [lambda: (randn(4, 24, dtype=torch.bfloat16, seed=11), randn(4, 1, dtype=torch.bfloat16, seed=12)),
                      lambda: (randn(3, 7, seed=13), randn(3, 1, seed=14))],
    "moe_combine": [lambda: moe_combine_args(torch.bfloat16), lambda: moe_combine_args(torch.float32)],
    "mxfp4_linear": [lambda: mxfp4_args(torch.bfloat16), lambda: mxfp4_args(torch.float32, bias=False)],
    "ssm_scan_": [ssm_scan_args],
    "causal_conv": [lambda: causal_conv_args(torch.bfloat16), lambda: causal_conv_args(torch.float32, bias=False)],
    "mamba_mixer": [lambda: mamba_mixer_args(torch.bfloat16), lambda: mamba_mixer_args(torch.float32)],
    "short_conv": [lambda: short_conv_args(torch.bfloat16), lambda: short_conv_args(torch.float32, bias=False)],
    "add_rows_": [lambda: (randn(6, 40, dtype=torch.bfloat16), randn(2, 40, dtype=torch.bfloat16, seed=1),
                           torch.tensor([4, 1])),
                  lambda: (randn(3, 20), randn(3, 20, seed=2), None)],
    "apply_token_bitmask_": [lambda: (randn(4, 50), torch.tensor([3, 0]), torch.tensor([[-1, 5], [7, -2]],
                                                                                       dtype=torch.int32)),
                             lambda: (randn(2, 64, dtype=torch.bfloat16), torch.tensor([1]),
                                      torch.tensor([[1, -1]], dtype=torch.int32))],
}

# (op, argument, a change to valid arguments that breaks a relation between them, message)
RELATIONS: list[tuple[str, str, Callable[[list[Any]], None], str]] = [
    ("rms_norm", "weight", lambda a: a.__setitem__(2, a[2][:63]), "must have x's row width 64"),
    ("rms_norm", "residual", lambda a: a.__setitem__(1, a[1][:4]), r"must have x's shape \[5, 64\]"),
    ("rms_norm_scaled", "weight", lambda a: a.__setitem__(2, a[2][:63]), "must have x's row width 64"),
    ("rms_norm_scaled", "residual", lambda a: a.__setitem__(1, a[1][:4]), r"must have x's shape \[5, 64\]"),
    ("layer_norm", "bias", lambda a: a.__setitem__(3, a[3][:63]), "must have x's row width 64"),
    ("layer_norm", "residual", lambda a: a.__setitem__(1, a[1][:4]), r"must have x's shape \[5, 64\]"),
    ("silu_and_mul", "gate_up", lambda a: a.__setitem__(0, a[0][:, :31].contiguous()), "must have an even width"),
    ("gelu_tanh_and_mul", "gate_up", lambda a: a.__setitem__(0, a[0][:, :31].contiguous()), "must have an even width"),
    ("rotary_", "head_dim", lambda a: a.__setitem__(2, 15), "must be even"),
    ("rotary_", "x", lambda a: a.__setitem__(1, 9), "fewer than num_heads"),
    ("rotary_", "cos", lambda a: a.__setitem__(3, a[3][:4]), r"must be \[tokens, rotary_dim\]"),
    ("latent_attention", "cache", lambda a: a.__setitem__(1, a[1][..., :24].contiguous()),
     r"one layer's latents, \[1, num_blocks, block_size, 1, 40\]"),
    ("latent_attention", "value_dim", lambda a: a.__setitem__(6, 48), r"no wider than the latent \(40\)"),
    ("latent_attention", "query_lens", lambda a: a.__setitem__(5, a[5][:1]), "one entry per block table"),
    ("latent_attention", "products", lambda a: a.__setitem__(8, "int8"), "must be one of"),
    ("latent_rotary", "x", lambda a: a.__setitem__(0, a[0][..., :7].contiguous()), "must have an even rotary width"),
    ("latent_rotary", "sin", lambda a: a.__setitem__(2, a[2][:4]), r"must be \[tokens, rotary width\] = \[5, 8\]"),
    ("paged_attention", "kv_cache", lambda a: a.__setitem__(0, a[0][:, :, :32].contiguous()),
     r"must be \[2, num_blocks, block_size, 2, 32\]"),
    ("paged_attention", "q", lambda a: a.__setitem__(0, a[0][:, :3].contiguous()), "multiple of kv_cache's 2"),
    ("paged_attention", "seq_lens", lambda a: a.__setitem__(3, a[3][:1]), "one entry per block table"),
    ("paged_attention", "paired", lambda a: a.__setitem__(7, True), "has no paired layout"),
    ("paged_attention", "window", lambda a: a.__setitem__(8, -3), "must be 0 .every key. or a number of keys"),
    ("paged_attention", "softcap", lambda a: a.__setitem__(9, -1.0), "must be 0 .none. or positive"),
    ("paged_attention", "sinks", lambda a: a.__setitem__(10, torch.zeros(3)), r"one logit per query head, \[4\]"),
    ("write_kv_paired", "v", lambda a: a.__setitem__(1, a[1][:5]), "must have k's shape"),
    ("write_kv_paired", "slots", lambda a: a.__setitem__(2, a[2][:5]), "one slot per token"),
    ("sample_rows", "uniforms", lambda a: a.__setitem__(2, a[2][:3]), "one value per row of logits"),
    ("sample_rows", "logits", lambda a: a.__setitem__(0, a[0][:, :0].contiguous()), "at least one column"),
    ("argmax_rows", "logits", lambda a: a.__setitem__(0, a[0][:, :0].contiguous()), "at least one column"),
    ("gemm_bf16", "packed", lambda a: a.__setitem__(3, 40), "has .* elements"),
    ("gemm_bf16", "bias", lambda a: a.__setitem__(2, a[2][:10]), r"must be a contiguous \[20\] bf16"),
    ("gemm_bf16", "isa", lambda a: a.__setitem__(4, "sse2"), "must be one of"),
    ("gemm_grouped_bf16", "packed", lambda a: a.__setitem__(3, 40), "rows have .* elements"),
    ("gemm_grouped_bf16", "starts", lambda a: a.__setitem__(2, a[2][:3]), r"one entry per weight and one more \(4\)"),
    ("gemm_grouped_bf16", "starts", lambda a: a.__setitem__(2, torch.tensor([0, 3, 2, 5])), "must rise from 0 to"),
    ("gemm_grouped_bf16", "starts", lambda a: a.__setitem__(2, torch.tensor([0, 3, 3, 4])), "must rise from 0 to"),
    ("gemm_grouped_bf16", "isa", lambda a: a.__setitem__(4, "sse2"), "must be one of"),
    ("moe_route", "top_k", lambda a: a.__setitem__(2, 13), r"must lie in \[1, 12\]"),
    ("moe_route", "top_k", lambda a: a.__setitem__(2, 0), r"must lie in \[1, 12\]"),
    ("moe_route", "bias", lambda a: a.__setitem__(1, randn(11)), r"one value per expert \(12\), got 11"),
    ("moe_route", "logits", lambda a: a.__setitem__(0, randn(1, 1025)), "at most 1024 experts"),
    ("moe_route", "group_rule", lambda a: a.__setitem__(10, 3), "must be one of"),
    ("moe_route", "num_groups", lambda a: a.__setitem__(8, 5) or a.__setitem__(10, 1), "must divide the 12 experts"),
    ("moe_route", "topk_groups", lambda a: a.__setitem__(8, 6) or a.__setitem__(10, 1) or a.__setitem__(2, 5),
     r"at least top_k \(5\) experts"),
    ("router_logits", "weight", lambda a: a.__setitem__(1, a[1][:, :39].contiguous()), r"must be \[experts, 40\]"),
    ("sigmoid_gate_", "gate", lambda a: a.__setitem__(1, a[1][:3]), r"one logit per row of x, \[4, 1\]"),
    ("moe_combine", "weights", lambda a: a.__setitem__(1, a[1][:3]), "one weight for each of y's 4 rows"),
    ("moe_combine", "pairs", lambda a: a.__setitem__(2, torch.tensor([[0, 4]])), "must name rows of y's 4"),
    ("mxfp4_linear", "x", lambda a: a.__setitem__(0, a[0][:, :48].contiguous()), "multiple of 32"),
    ("mxfp4_linear", "blocks", lambda a: a.__setitem__(1, a[1][:, :1].contiguous()), r"must be \[n, 2, 16\]"),
    ("mxfp4_linear", "scales", lambda a: a.__setitem__(2, a[2][:10].contiguous()), r"must be \[20, 2\]"),
    ("mxfp4_linear", "bias", lambda a: a.__setitem__(3, a[3][:10]), r"one value per output, \[20\]"),
    ("mxfp4_linear", "isa", lambda a: a.__setitem__(4, "sse2"), "must be one of"),
    ("ssm_scan_", "x", lambda a: a.__setitem__(5, a[5][:, :, :3].contiguous()), r"must have shape \[4, 2, 4\]"),
    ("ssm_scan_", "B", lambda a: a.__setitem__(8, a[8][:2].contiguous()), r"must have shape \[4, 2, 8\]"),
    ("ssm_scan_", "lengths", lambda a: a.__setitem__(4, a[4][:2].contiguous()), r"must have shape \[3\]"),
    ("ssm_scan_", "state", lambda a: a.__setitem__(0, torch.zeros(4, 2, 4, 513)), "at most 512, got 4, 513"),
    ("causal_conv", "weight_t", lambda a: a.__setitem__(1, a[1][:, :5].contiguous()), r"must be \[k, 6\]"),
    ("causal_conv", "bias", lambda a: a.__setitem__(2, a[2][:5]), "one value per channel"),
    ("causal_conv", "conv_state", lambda a: a.__setitem__(3, a[3][:, :2].contiguous()),
     r"must be \[slots, 3, 6\]"),
    ("causal_conv", "lengths", lambda a: a.__setitem__(5, a[5][:1]), "one value per request"),
    ("short_conv", "proj", lambda a: a.__setitem__(0, a[0][:, :12].contiguous()), r"must be \[tokens, 18\]"),
    ("mamba_mixer", "proj", lambda a: a.__setitem__(0, a[0][:, :60].contiguous()), r"must be \[tokens, 68\]"),
    ("mamba_mixer", "ssm_state", lambda a: a.__setitem__(13, 3), "with 3 groups dividing the heads"),
    ("mamba_mixer", "conv_state", lambda a: a.__setitem__(3, a[3][:, :2].contiguous()), r"must be \[2, 3, 48\]"),
    ("mamba_mixer", "D", lambda a: a.__setitem__(7, a[7][:3]), "must hold 4 values"),
    ("add_rows_", "rows", lambda a: a.__setitem__(2, torch.tensor([4, 6])), r"must lie in \[0, 6\)"),
    ("add_rows_", "delta", lambda a: a.__setitem__(1, a[1][:, :39].contiguous()), "must have y's row width 40"),
    ("apply_token_bitmask_", "rows", lambda a: a.__setitem__(1, a[1][:1]), "one row of logits per bitmask row"),
    ("apply_token_bitmask_", "bitmask", lambda a: a.__setitem__(2, a[2][:, :1].contiguous()), "a bit per token"),
]

needs_native = pytest.mark.skipif(not all(op.available() for op in OPS.values()), reason="a C++ source did not build")
CALLS = [pytest.param(name, index, id=f"{name}-{index}") for name in EXAMPLES for index in range(len(EXAMPLES[name]))]


def paths(name: str) -> list[Callable[..., Any]]:
    """The two ways into an op: the dispatcher (torch.ops) and NativeOp.call's direct path."""
    return [getattr(torch.ops.kvloom, name).default, OPS[name].call]


def tensor_arguments(name: str, args: tuple[Any, ...]) -> list[tuple[int, str]]:
    return [(index, argument) for index, argument in enumerate(OPS[name].arguments)
            if argument in OPS[name].tensors and args[index] is not None]


def test_every_op_has_examples_and_is_registered() -> None:
    assert set(EXAMPLES) == set(OPS), "each op needs valid examples here"
    for name, op in OPS.items():
        assert getattr(torch.ops.kvloom, name).default is op.overload
        assert str(op.overload._schema).startswith(f"kvloom::{name}(")


@needs_native
@pytest.mark.parametrize(("name", "index"), CALLS)
def test_wrong_dtype_rank_layout_or_device_raises_naming_the_argument(name: str, index: int) -> None:
    args = EXAMPLES[name][index]()
    for position, argument in tensor_arguments(name, args):
        tensor = args[position]
        strided = torch.empty(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)[..., ::2]
        wrong = {"dtype": tensor.double(), "rank": tensor.unsqueeze(0),
                 "layout": strided.copy_(tensor) if tensor.shape[-1] > 1 else None,
                 "device": tensor.to("meta"), "type": 3 if position else None}
        for kind, value in wrong.items():
            if value is None:
                continue
            bad = list(args)
            bad[position] = value
            # The dispatcher sends a call with a meta tensor to the fake kernel (shapes
            # only), and rejects a non-tensor itself (TypeError): the direct path here.
            for call in paths(name)[1:] if kind in ("device", "type") else paths(name):
                with pytest.raises(ValueError, match=rf"^kvloom::{name}: {argument} must be a .*got"):
                    call(*bad)


@needs_native
@pytest.mark.parametrize(("name", "argument", "change", "message"), RELATIONS,
                         ids=[f"{name}-{argument}" for name, argument, _, _ in RELATIONS])
def test_arguments_that_disagree_raise_naming_the_argument(name: str, argument: str, change: Callable,
                                                           message: str) -> None:
    if name == "write_kv_paired" and not PAIRED:
        pytest.skip("no paired layout on this CPU")
    bad = list(EXAMPLES[name][0]())
    change(bad)
    for call in paths(name):
        with pytest.raises(ValueError, match=rf"^kvloom::{name}: {argument} .*{message}"):
            call(*bad)


@needs_native
def test_a_bf16_cache_with_float32_queries_raises() -> None:
    args = list(attention_args(torch.bfloat16, False))
    args[0] = args[0].float()
    with pytest.raises(ValueError, match=r"^kvloom::paged_attention: q must be a contiguous 3-D bf16 \(kv_cache's"):
        paged_attention.paged_attention(*args)


def clone(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of the tensors with the same strides (strided rows stay strided)."""
    return tuple(torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype).copy_(arg)
                 if isinstance(arg, torch.Tensor) else arg for arg in args)


@needs_native
@pytest.mark.parametrize(("name", "index"), CALLS)
def test_the_direct_path_equals_the_dispatcher(name: str, index: int) -> None:
    if name == "write_kv_paired" and not PAIRED:
        pytest.skip("no paired layout on this CPU")
    args = EXAMPLES[name][index]()
    through_torch, direct = clone(args), clone(args)
    want, got = paths(name)[0](*through_torch), OPS[name].call(*direct)
    wanted, gotten = (want, got) if isinstance(want, tuple) else ((want,), (got,))  # an op may return several
    assert all((w is None and g is None) or torch.equal(w, g) for w, g in zip(wanted, gotten, strict=True))
    for a, b in zip(through_torch, direct, strict=True):  # and they wrote the same
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)


@needs_native
@pytest.mark.parametrize(("name", "index"), CALLS)
def test_opcheck(name: str, index: int) -> None:
    """Schema (mutations declared are the mutations made; new outputs alias nothing), the
    autograd registration, fake tensors against real ones, and AOT dispatch with dynamic
    shapes (functionalization of the mutating ops)."""
    if name == "write_kv_paired" and not PAIRED:
        pytest.skip("no paired layout on this CPU")
    torch.library.opcheck(getattr(torch.ops.kvloom, name).default, EXAMPLES[name][index]())


@needs_native
def test_tracing_and_dispatch_modes_see_the_op() -> None:
    """The direct path steps aside for whatever could intercept a call: a dispatch mode
    (here one that records), FakeTensor, torch.compile (one graph, the op in it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, weight = randn(3, 8), randn(8, seed=1)
    with Record() as record:
        cpu_ops.rms_norm(x, None, weight, 1e-5)
    assert "kvloom.rms_norm.default" in record.seen
    with FakeTensorMode():
        assert cpu_ops.silu_and_mul(torch.empty(5, 12)).shape == (5, 6)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: cpu_ops.rms_norm(x, None, w, 1e-5) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, weight), cpu_ops.rms_norm(x, None, weight, 1e-5) * 2)


# ---- the declarations against the C sources -----------------------------------------
C_TYPES = {"int64_t": "int", "int": "int32", "float": "float"}
C_RESULTS = {"void": "()", "int": "int32", "int64_t": "int"}
PROTOTYPE = re.compile(r"^(void|int|int64_t)\s+(kvloom_\w+)\(([^)]*)\)\s*\{", re.M)
C_PARAMETER = re.compile(r"(const\s+)?(\w+)\s*(\*)?\s*(\w+)")


def c_prototypes(library: str) -> dict[str, tuple[str, list[tuple[str, str, bool]]]]:
    """symbol -> (result, [(name, type as a declaration spells it, const pointer)])."""
    source = (native.SOURCES / f"{library}.cpp").read_text()
    prototypes = {}
    for result, symbol, parameters in PROTOTYPE.findall(source):
        parsed = []
        for text in filter(None, (part.strip() for part in parameters.split(","))):
            const, c_type, pointer, name = C_PARAMETER.fullmatch(" ".join(text.split())).groups()
            parsed.append((name, "Tensor" if pointer else C_TYPES[c_type], bool(pointer and const)))
        prototypes[symbol] = (C_RESULTS[result], parsed)
    return prototypes


@pytest.mark.parametrize("function", native_op.FUNCTIONS, ids=lambda function: function.symbol)
def test_declarations_match_the_c_prototypes(function: native_op.NativeFunction) -> None:
    """Names, order and types of every declared C function's parameters, and const-ness:
    C writes through a pointer taken from an op argument exactly when the schema marks
    that argument mutated (Tensor(a!))."""
    prototypes = c_prototypes(function.library)
    for symbol in function.symbols():
        assert symbol in prototypes, f"{symbol} is not in csrc/{function.library}.cpp"
        result, parameters = prototypes[symbol]
        assert result == function.result, symbol
        declared = [(param.name, param.type.rstrip("?")) for param in function.params]
        assert declared == [(name, c_type) for name, c_type, _ in parameters], symbol
        for param, (name, _, const) in zip(function.params, parameters, strict=True):
            if param.from_schema and param.type.startswith("Tensor"):
                assert param.written == (not const), f"{symbol}: {name} is {'' if const else 'not '}const in C"


@pytest.mark.parametrize(("declaration", "message"), [
    (dict(native="kvloom_f(x, y) -> ()"), "'y' .* is neither typed nor an argument"),
    (dict(native="kvloom_f(x) -> float"), "not a native declaration"),
    (dict(native="kvloom_f(x, Tensor* y) -> ()"), "bad parameter"),
    (dict(tensors={}), "every Tensor argument needs a TensorSpec"),
    (dict(tensors={"x": native_op.TensorSpec(1, like="z")}), "like must name a Tensor"),
])
def test_declaration_mistakes_are_refused_before_anything_registers(declaration: dict, message: str) -> None:
    fields = dict(library="sampling", native="kvloom_f(x) -> ()", tensors={"x": native_op.TensorSpec(1)}) | declaration
    with pytest.raises(ValueError, match=message):
        native_op.NativeOp("never_registered(Tensor x) -> ()", **fields)
    assert "never_registered" not in OPS and not hasattr(torch.ops.kvloom, "never_registered")
    assert all(function.symbol != "kvloom_f" for function in native_op.FUNCTIONS)


def test_kernels_import_nothing_above_them() -> None:
    code = ("import sys\nimport kvloom.kernels.cpu_ops, kvloom.kernels.decoder_stack, kvloom.kernels.gemm, "
            "kvloom.kernels.mxfp4, kvloom.kernels.paged_attention, "
            "kvloom.kernels.sampling, kvloom.kernels.ssm\n"
            "print(' '.join(m for m in sys.modules if m.split('.')[:2] in (['kvloom', 'models'], "
            "['kvloom', 'attention'], ['kvloom', 'runner'], ['kvloom', 'engine'], ['kvloom', 'server'])))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == ""

