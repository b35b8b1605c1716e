"""The fused elementwise ops of a decoder layer (kvloom/csrc/cpu_ops.cpp), float32 and
bf16: ``kvloom::rms_norm``, ``kvloom::rms_norm_scaled`` (Gemma's and OLMo 2's: the scale in
float32 before the rounding), ``kvloom::layer_norm`` (with a weight and a bias),
``kvloom::silu_and_mul``, ``kvloom::gelu_tanh_and_mul`` (Gemma's GeGLU), ``kvloom::gelu_tanh``,
``kvloom::gelu_erf``, ``kvloom::relu`` and ``kvloom::relu2`` (the un-gated MLP's), ``kvloom::rotary_``,
``kvloom::clamp_`` (OLMo 1's clip, for the native walk; the modules call torch's),
``kvloom::add_rows_`` (LoRA's deltas added in; its reference is torch's own add) and
``kvloom::moe_route``, ``kvloom::moe_combine`` and ``kvloom::sigmoid_gate_`` (a mixture-of-experts
layer's top-k routing, its weighted expert outputs added up per token, and Qwen2-MoE's gate on its
shared expert; their references are models/moe.py's torch ops).

models/ops.py calls all but the last on CPU and keeps the pure-PyTorch references (the oracle in
tests/models/test_ops.py, and what runs where this source does not build).
"""

from __future__ import annotations

import torch

from kvloom.kernels.native_op import NativeOp, TensorSpec

ACTIVATIONS = (torch.float32, torch.bfloat16)
_VARIANT = {torch.float32: "f32", torch.bfloat16: "bf16"}


def available() -> bool:
    """Whether cpu_ops.cpp builds here."""
    return RMS_NORM.available()


def _check_norm(op: NativeOp, x: torch.Tensor, residual: torch.Tensor | None, **vectors: torch.Tensor) -> None:
    """A norm's relations: ``residual`` of x's shape, each named vector (weight, bias) of x's row width."""
    if residual is not None and residual.shape != x.shape:
        raise op.error("residual", f"must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    for name, vector in vectors.items():
        if vector.shape[0] != x.shape[1]:
            raise op.error(name, f"must have x's row width {x.shape[1]}, got {vector.shape[0]}")


# ---- RMSNorm, optionally fused with the residual add ---------------------------------
RMS_NORM = NativeOp(
    "rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_rms_norm_{variant}(x, residual, weight, Tensor out, int rows, int n, eps) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS), "residual": TensorSpec(2, like="x"), "weight": TensorSpec(1, like="x")},
)


@RMS_NORM.check
def _rms_norm_check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
    _check_norm(RMS_NORM, x, residual, weight=weight)


@RMS_NORM.implementation
def _rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    RMS_NORM.function(_VARIANT[x.dtype])(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], eps)
    return out


@RMS_NORM.fake
def _rms_norm_fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) for x: [rows, n]; with ``residual``, first ``residual += x`` in
    place and normalise that sum (models/ops.py has the reference)."""
    return RMS_NORM.call(x, residual, weight, eps)


# ---- RMSNorm scaled in float32 (Gemma, OLMo 2) ----------------------------------------
RMS_NORM_SCALED = NativeOp(
    "rms_norm_scaled(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, float offset) -> Tensor",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_rms_norm_scaled_{variant}(x, residual, weight, Tensor out, int rows, int n, eps, offset) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS), "residual": TensorSpec(2, like="x"), "weight": TensorSpec(1, like="x")},
)


@RMS_NORM_SCALED.check
def _rms_norm_scaled_check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           offset: float) -> None:
    _check_norm(RMS_NORM_SCALED, x, residual, weight=weight)


@RMS_NORM_SCALED.implementation
def _rms_norm_scaled_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         offset: float) -> torch.Tensor:
    out = torch.empty_like(x)
    RMS_NORM_SCALED.function(_VARIANT[x.dtype])(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], eps, offset)
    return out


@RMS_NORM_SCALED.fake
def _rms_norm_scaled_fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          offset: float) -> torch.Tensor:
    return torch.empty_like(x)


def rms_norm_scaled(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    offset: float) -> torch.Tensor:
    """x / rms(x) * (offset + weight) for x: [rows, n], both products in float32 before the
    one rounding; ``residual`` as :func:`rms_norm`'s (models/ops.py has the reference)."""
    return RMS_NORM_SCALED.call(x, residual, weight, eps, offset)


# ---- LayerNorm with a weight and a bias (StarCoder2, GPT-2, Phi, GPT-NeoX, StableLM, OLMo 1) --
LAYER_NORM = NativeOp(
    "layer_norm(Tensor x, Tensor(a!)? residual, Tensor weight, Tensor bias, float eps) -> Tensor",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_layer_norm_{variant}(x, residual, weight, bias, Tensor out, int rows, int n, eps) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS), "residual": TensorSpec(2, like="x"), "weight": TensorSpec(1, like="x"),
             "bias": TensorSpec(1, like="x")},
)


@LAYER_NORM.check
def _layer_norm_check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> None:
    _check_norm(LAYER_NORM, x, residual, weight=weight, bias=bias)


@LAYER_NORM.implementation
def _layer_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    LAYER_NORM.function(_VARIANT[x.dtype])(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), bias.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


@LAYER_NORM.fake
def _layer_norm_fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias for x: [rows, n], in float32 before the
    one rounding; ``residual`` as :func:`rms_norm`'s (torch's layer_norm is the reference)."""
    return LAYER_NORM.call(x, residual, weight, bias, eps)


# ---- the MLP's activations -----------------------------------------------------------
def _gated_activation(name: str) -> NativeOp:
    """``name(gate_up)``: act(gate) * up for gate_up = [gate | up], [rows, 2n] -> [rows, n]
    (kvloom_<name>_{f32,bf16} in cpu_ops.cpp)."""
    op = NativeOp(f"{name}(Tensor gate_up) -> Tensor", library="cpu_ops", variants=("f32", "bf16"),
                  native=f"kvloom_{name}_{{variant}}(gate_up, Tensor out, int rows, int n) -> ()",
                  tensors={"gate_up": TensorSpec(2, ACTIVATIONS)})

    @op.check
    def _check(gate_up: torch.Tensor) -> None:
        if gate_up.shape[1] % 2:
            raise op.error("gate_up", f"must have an even width ([gate | up]), got {gate_up.shape[1]}")

    @op.implementation
    def _cpu(gate_up: torch.Tensor) -> torch.Tensor:
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype)  # [rows, n]
        op.function(_VARIANT[gate_up.dtype])(gate_up.data_ptr(), out.data_ptr(), rows, n)
        return out

    @op.fake
    def _fake(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    return op


def _activation(name: str) -> NativeOp:
    """``name(x)``: an element-wise activation of x, [rows, n] (kvloom_<name>_{f32,bf16})."""
    op = NativeOp(f"{name}(Tensor x) -> Tensor", library="cpu_ops", variants=("f32", "bf16"),
                  native=f"kvloom_{name}_{{variant}}(x, Tensor out, int rows, int n) -> ()",
                  tensors={"x": TensorSpec(2, ACTIVATIONS)})

    @op.implementation
    def _cpu(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        op.function(_VARIANT[x.dtype])(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
        return out

    @op.fake
    def _fake(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return op


SILU_AND_MUL = _gated_activation("silu_and_mul")
GELU_TANH_AND_MUL = _gated_activation("gelu_tanh_and_mul")
GELU_TANH = _activation("gelu_tanh")
GELU_ERF = _activation("gelu_erf")
RELU = _activation("relu")
RELU2 = _activation("relu2")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: [rows, 2n] -> [rows, n]."""
    return SILU_AND_MUL.call(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up]: [rows, 2n] -> [rows, n]."""
    return GELU_TANH_AND_MUL.call(gate_up)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form of x: [rows, n] (torch's ``F.gelu(x, approximate="tanh")``)."""
    return GELU_TANH.call(x)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GELU's exact form of x: [rows, n] (torch's ``F.gelu(x)``), erfc within 1.2e-7 of itself."""
    return GELU_ERF.call(x)


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU of x: [rows, n] (torch's ``torch.relu``: -0 and NaN pass)."""
    return RELU.call(x)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU's square of x: [rows, n] (transformers' relu2, ``torch.square(torch.relu(x))``)."""
    return RELU2.call(x)


# ---- rotary embedding, in place ------------------------------------------------------
ROTARY = NativeOp(
    "rotary_(Tensor(a!) x, int num_heads, int head_dim, Tensor cos, Tensor sin) -> ()",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_rotary_{variant}(x, int row_stride, cos, sin, int tokens, num_heads, head_dim, "
           "int rotary_dim) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS, rows=True), "cos": TensorSpec(2, (torch.float32,)),
             "sin": TensorSpec(2, (torch.float32,))},
)


@ROTARY.check
def _rotary_check(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if head_dim <= 0 or head_dim % 2 or num_heads < 0:
        raise ROTARY.error("head_dim", f"must be even and positive (num_heads >= 0), got {head_dim} "
                                       f"(num_heads {num_heads})")
    if num_heads * head_dim > x.shape[1]:
        raise ROTARY.error("x", f"has rows of {x.shape[1]} values, fewer than num_heads * head_dim = "
                                f"{num_heads * head_dim}")
    rotary_dim = cos.shape[1]  # the head's first rotary_dim dimensions turn (Phi-4's part; else all)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ROTARY.error("cos", f"must be [tokens, rotary_dim] with rotary_dim even and at most head_dim "
                                  f"{head_dim}, got {list(cos.shape)}")
    tables = (x.shape[0], rotary_dim)
    if cos.shape != tables or sin.shape != tables:
        name = "cos" if cos.shape != tables else "sin"
        raise ROTARY.error(name, f"must be [tokens, rotary_dim] = {list(tables)}, got "
                                 f"{list((cos if name == 'cos' else sin).shape)}")


@ROTARY.implementation
def _rotary_cpu(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    ROTARY.function(_VARIANT[x.dtype])(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], num_heads, head_dim, cos.shape[1])


@ROTARY.fake
def _rotary_fake(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    return None


def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first ``num_heads`` head vectors of each row of x: [tokens,
    width]; cos/sin: [tokens, head_dim] float32."""
    ROTARY.call(x, num_heads, head_dim, cos, sin)


# ---- clamped in place (OLMo 1's clip_qkv, in the native walk) -------------------------
CLAMP = NativeOp(
    "clamp_(Tensor(a!) x, float limit) -> ()",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_clamp_{variant}(x, int count, limit) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS)},
)


@CLAMP.implementation
def _clamp_cpu(x: torch.Tensor, limit: float) -> None:
    CLAMP.function(_VARIANT[x.dtype])(x.data_ptr(), x.numel(), limit)


@CLAMP.fake
def _clamp_fake(x: torch.Tensor, limit: float) -> None:
    return None


def clamp_(x: torch.Tensor, limit: float) -> None:
    """``x.clamp_(-limit, limit)``, bit for bit but for NaN payloads (torch's is the reference)."""
    CLAMP.call(x, limit)


# ---- rows added into, in place (LoRA's deltas) ---------------------------------------
ADD_ROWS = NativeOp(
    "add_rows_(Tensor(a!) y, Tensor delta, Tensor? rows) -> ()",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_add_rows_{variant}(y, delta, rows, int count, int n) -> ()",
    tensors={"y": TensorSpec(2, ACTIVATIONS), "delta": TensorSpec(2, like="y"), "rows": TensorSpec(1, (torch.int64,))},
)


@ADD_ROWS.check
def _add_rows_check(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    if delta.shape[1] != y.shape[1]:
        raise ADD_ROWS.error("delta", f"must have y's row width {y.shape[1]}, got {delta.shape[1]}")
    if rows is None:
        if delta.shape[0] != y.shape[0]:
            raise ADD_ROWS.error("delta", f"must have y's {y.shape[0]} rows (no rows given), got {delta.shape[0]}")
        return
    if rows.shape[0] != delta.shape[0]:
        raise ADD_ROWS.error("rows", f"must name one row of y for each of delta's {delta.shape[0]}, got "
                                     f"{rows.shape[0]}")


@ADD_ROWS.implementation
def _add_rows_cpu(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    # The rows' values are data, which a fake tensor does not have: checked here, where they are.
    if rows is not None and rows.shape[0] and not (0 <= int(rows.min()) and int(rows.max()) < y.shape[0]):
        raise ADD_ROWS.error("rows", f"must lie in [0, {y.shape[0]}), got {rows.tolist()}")
    ADD_ROWS.function(_VARIANT[y.dtype])(y.data_ptr(), delta.data_ptr(), 0 if rows is None else rows.data_ptr(),
                                         delta.shape[0], y.shape[1])


@ADD_ROWS.fake
def _add_rows_fake(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    return None


def add_rows_(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """``y[rows] += delta`` in place (every row of y where ``rows`` is None; the rows
    distinct), each sum rounded once to y's dtype: torch's ``y += delta`` and
    ``y.index_add_(0, rows, delta)``, the reference (tests/kernels/test_add_rows.py)."""
    ADD_ROWS.call(y, delta, rows)


# ---- Qwen2-MoE's shared expert times the sigmoid of its gate, in place ------------------
SIGMOID_GATE = NativeOp(
    "sigmoid_gate_(Tensor(a!) x, Tensor gate) -> ()",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_sigmoid_gate_{variant}(x, gate, int rows, int n) -> ()",
    tensors={"x": TensorSpec(2, ACTIVATIONS), "gate": TensorSpec(2, like="x")},
)


@SIGMOID_GATE.check
def _sigmoid_gate_check(x: torch.Tensor, gate: torch.Tensor) -> None:
    if tuple(gate.shape) != (x.shape[0], 1):
        raise SIGMOID_GATE.error("gate", f"must be one logit per row of x, [{x.shape[0]}, 1], got {list(gate.shape)}")


@SIGMOID_GATE.implementation
def _sigmoid_gate_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    SIGMOID_GATE.function(_VARIANT[x.dtype])(x.data_ptr(), gate.data_ptr(), x.shape[0], x.shape[1])


@SIGMOID_GATE.fake
def _sigmoid_gate_fake(x: torch.Tensor, gate: torch.Tensor) -> None:
    return None


def sigmoid_gate_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """``x *= sigmoid(gate)`` in place, gate [rows, 1], the sigmoid rounded to x's dtype first
    (torch's ``torch.sigmoid(gate) * x``, its sigmoid to within an ulp)."""
    SIGMOID_GATE.call(x, gate)


# ---- a float32 router's logits (DeepSeek's) ------------------------------------------
ROUTER_LOGITS = NativeOp(
    "router_logits(Tensor x, Tensor weight) -> Tensor",
    library="cpu_ops",
    native="kvloom_router_logits_bf16(x, weight, Tensor logits, int tokens, int num_experts, int n) -> ()",
    tensors={"x": TensorSpec(2, (torch.bfloat16,)), "weight": TensorSpec(2, (torch.float32,))},
)


@ROUTER_LOGITS.check
def _router_logits_check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape[1] != x.shape[1]:
        raise ROUTER_LOGITS.error("weight", f"must be [experts, {x.shape[1]}] for x's rows, got {list(weight.shape)}")


@ROUTER_LOGITS.implementation
def _router_logits_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    ROUTER_LOGITS.function()(x.data_ptr(), weight.data_ptr(), logits.data_ptr(), x.shape[0], weight.shape[0],
                             x.shape[1])
    return logits


@ROUTER_LOGITS.fake
def _router_logits_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A float32 router's logits [tokens, experts] = x [tokens, n] (bf16) . weight [experts, n]
    (float32), in float32 (transformers' ``F.linear(x.float(), weight)`` to float32 rounding):
    each logit's operations fixed, so a row's logits are the same whatever rows share the call
    (csrc/cpu_ops.cpp's ``router`` has the order)."""
    out: torch.Tensor = ROUTER_LOGITS.call(x, weight)
    return out


# ---- a mixture-of-experts layer's outputs, weighted and added per token ---------------
MOE_COMBINE = NativeOp(
    "moe_combine(Tensor y, Tensor weights, Tensor pairs) -> Tensor",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_moe_combine_{variant}(y, weights, pairs, Tensor out, int tokens, int k, int n) -> ()",
    tensors={"y": TensorSpec(2, ACTIVATIONS), "weights": TensorSpec(1, (torch.float32,)),
             "pairs": TensorSpec(2, (torch.int64,))},
)


@MOE_COMBINE.check
def _moe_combine_check(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> None:
    if weights.shape[0] != y.shape[0]:
        raise MOE_COMBINE.error("weights", f"must have one weight for each of y's {y.shape[0]} rows, got "
                                           f"{weights.shape[0]}")


@MOE_COMBINE.implementation
def _moe_combine_cpu(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    # The pairs' values are data, which a fake tensor does not have: checked here, where they are.
    if pairs.numel() and int(pairs.max()) >= y.shape[0]:
        raise MOE_COMBINE.error("pairs", f"must name rows of y's {y.shape[0]} (or be negative: none), got "
                                         f"{int(pairs.max())}")
    out = torch.empty(pairs.shape[0], y.shape[1], dtype=y.dtype)
    MOE_COMBINE.function(_VARIANT[y.dtype])(y.data_ptr(), weights.data_ptr(), pairs.data_ptr(), out.data_ptr(),
                                            pairs.shape[0], pairs.shape[1], y.shape[1])
    return out


@MOE_COMBINE.fake
def _moe_combine_fake(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return y.new_empty(pairs.shape[0], y.shape[1])


def moe_combine(y: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """out[t] = the sum over r of ``(y[pairs[t, r]] * weights[pairs[t, r]]).to(y.dtype)``,
    added in r's order onto zeros, each sum rounded to y's dtype (a negative entry: no
    row): y [rows, n], weights [rows] float32, pairs [tokens, k] int64 -> [tokens, n]."""
    return MOE_COMBINE.call(y, weights, pairs)


# ---- a mixture-of-experts router's top-k ---------------------------------------------------
MAX_ROUTED_EXPERTS = 1024  # cpu_ops.cpp's per-token scores on the stack
MOE_ROUTE = NativeOp(
    "moe_route(Tensor logits, Tensor? bias, int top_k, int sigmoid, int norm, float eps, float scaling, "
    "int round_to_bf16, int num_groups, int topk_groups, int group_rule) -> (Tensor, Tensor)",
    library="cpu_ops", variants=("f32", "bf16"),
    native="kvloom_moe_route_{variant}(logits, bias, Tensor weights, Tensor experts, int tokens, int num_experts, "
           "top_k, sigmoid, norm, eps, scaling, round_to_bf16, num_groups, topk_groups, group_rule) -> int32",
    tensors={"logits": TensorSpec(2, ACTIVATIONS), "bias": TensorSpec(1, (torch.float32,))},
)


# moe_route's group_rule (csrc/cpu_ops.cpp's GroupRule): no groups; DeepSeek-V2's group_limited_greedy
# (a group scored by its best expert); DeepSeek-V3's noaux_tc (by the sum of its best two).
GROUP_RULES = {"none": 0, "best": 1, "top2_sum": 2}


@MOE_ROUTE.check
def _moe_route_check(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: int, norm: int,
                     eps: float, scaling: float, round_to_bf16: int, num_groups: int, topk_groups: int,
                     group_rule: int) -> None:
    if not 1 <= top_k <= logits.shape[1]:
        raise MOE_ROUTE.error("top_k", f"must lie in [1, {logits.shape[1]}] (the experts), got {top_k}")
    if group_rule not in GROUP_RULES.values():
        raise MOE_ROUTE.error("group_rule", f"must be one of {sorted(GROUP_RULES.values())}, got {group_rule}")
    if group_rule:
        experts = logits.shape[1]
        if not (num_groups >= 1 and experts % num_groups == 0 and 1 <= topk_groups <= num_groups):
            raise MOE_ROUTE.error("num_groups", f"must divide the {experts} experts, with topk_groups in [1, "
                                                f"num_groups], got {num_groups} and {topk_groups}")
        size = experts // num_groups
        if topk_groups * size < top_k or (group_rule == GROUP_RULES["top2_sum"] and size < 2):
            raise MOE_ROUTE.error("topk_groups", f"must leave at least top_k ({top_k}) experts in the chosen groups "
                                                 f"(and two a group for top2_sum), got {topk_groups} of {size}")
    if logits.shape[1] > MAX_ROUTED_EXPERTS:
        raise MOE_ROUTE.error("logits", f"must have at most {MAX_ROUTED_EXPERTS} experts, got {logits.shape[1]}")
    if bias is not None and bias.shape[0] != logits.shape[1]:
        raise MOE_ROUTE.error("bias", f"must hold one value per expert ({logits.shape[1]}), got {bias.shape[0]}")


@MOE_ROUTE.implementation
def _moe_route_cpu(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: int, norm: int, eps: float,
                   scaling: float, round_to_bf16: int, num_groups: int, topk_groups: int,
                   group_rule: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    experts = torch.empty(tokens, top_k, dtype=torch.int64)
    status = MOE_ROUTE.function(_VARIANT[logits.dtype])(
        logits.data_ptr(), 0 if bias is None else bias.data_ptr(), weights.data_ptr(), experts.data_ptr(), tokens,
        num_experts, top_k, sigmoid, norm, eps, scaling, round_to_bf16, num_groups, topk_groups, group_rule)
    assert status == 0, "the check above refuses what the kernel would"
    return weights, experts


@MOE_ROUTE.fake
def _moe_route_fake(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: int, norm: int, eps: float,
                    scaling: float, round_to_bf16: int, num_groups: int, topk_groups: int,
                    group_rule: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (logits.new_empty(logits.shape[0], top_k, dtype=torch.float32),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.int64))


def moe_route(logits: torch.Tensor, top_k: int, norm: bool, scaling: float = 1.0, round_to_bf16: bool = False,
              sigmoid: bool = False, bias: torch.Tensor | None = None, eps: float = 0.0,
              groups: tuple[int, int, str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, top_k] float32, experts
    [tokens, top_k] int64): each token's scores (a softmax, or where ``sigmoid`` each
    logit's sigmoid), its top_k experts by score + ``bias`` (float32 [experts], a selection
    bias; None: none) in descending order (ties to the lower expert), their scores divided
    by their sum plus ``eps`` where ``norm``, times ``scaling``, rounded to bf16 where
    ``round_to_bf16`` (models/moe.py's ``route`` for the forms ``routes_natively`` names, to
    float32 rounding; a token's result is its own). ``groups``: (num_groups, topk_groups, rule) where
    the choice is group-limited (DeepSeek's): the experts in num_groups equal groups, each scored by
    its best score + bias (rule "best") or the sum of its best two ("top2_sum"), the top_k from the
    topk_groups best groups (ties to the lower group)."""
    num_groups, topk_groups, rule = groups if groups is not None else (1, 1, "none")
    return MOE_ROUTE.call(logits, bias, top_k, int(sigmoid), int(norm), eps, scaling, int(round_to_bf16), num_groups,
                          topk_groups, GROUP_RULES[rule])
