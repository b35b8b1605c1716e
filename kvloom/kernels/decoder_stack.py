"""Every decoder layer of a Llama-family or Gemma model in one native call
(kvloom/csrc/decoder_stack.cpp): the same kernels as the module path, walked in C.

The kernel table holds the entry points of those kernels (``rms_norm``, ``gemm_bf16``,
``rotary_``, ``write_kv_paired``, ``paged_attention``, ``silu_and_mul``, the all-reduce,
``add_rows_`` (LoRA's), Gemma's ``rms_norm_scaled`` and ``gelu_tanh_and_mul``, StarCoder2's,
GPT-2's, Phi's and GPT-NeoX's ``layer_norm``, ``gelu_tanh`` and ``gelu_erf``, the hybrids'
state layers' and the mixture-of-experts layers' ``gemm_grouped_bf16``, ``moe_route`` and
``moe_combine``), which
the C walk calls in the module path's order; :func:`run` checks what the walk
will read and write (dtypes, shapes, contiguity of every tensor, once per forward
instead of once per kernel) and calls it. The weight table is built by
kvloom/models/decoder_stack.py from the model's checked, packed tensors, which it keeps
alive. As for the attention kernel, the index arrays are the caller's contract (see
kernels/paged_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvloom.kernels import cpu_ops, gemm, latent_attention, paged_attention, shm_collectives, ssm
from kvloom.kernels.native_op import NativeFunction, NativeOp, profiled

_SCRATCH = NativeFunction("decoder_stack", "kvloom_decoder_stack_scratch(int tokens, int hidden_size, int q_size, "
                                           "int kv_size, int intermediate, int mixer_width, int moe_width, "
                                           "int latent_width) -> int")
_LATENT_WIDTH = NativeFunction("decoder_stack", "kvloom_decoder_stack_latent_width(int heads, int rank, int rope, "
                                                "int nope, int v, int q_rank) -> int")
_MOE_WIDTH = NativeFunction("decoder_stack", "kvloom_decoder_stack_moe_width(int num_experts, int top_k, int inter, "
                                             "int hidden_size) -> int")
_MIXER_WIDTH = NativeFunction("decoder_stack", "kvloom_decoder_stack_mixer_width(int inter, int conv_dim, "
                                               "int heads, int hidden_size, int short_kernel) -> int")
_STACK = NativeFunction(
    "decoder_stack",
    "kvloom_decoder_stack(Tensor kernels, Tensor weights, int num_layers, Tensor residual, Tensor hidden, "
    "Tensor scratch, Tensor kv_caches, int num_blocks, Tensor cos, Tensor sin, Tensor cos_local, Tensor sin_local, "
    "Tensor slots, Tensor block_tables, "
    "int max_blocks, Tensor seq_lens, Tensor query_start, Tensor query_lens, int num_seqs, int tokens, "
    "int hidden_size, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, int intermediate, "
    "int block_size, "
    "float eps, float scale, float residual_scale, float softcap, int32 norm, float norm_offset, int32 activation, "
    "int32 qk_norm_whole, int32 parallel, float clip, int32 isa, int32 num_threads, Tensor reduce, int split_seqs, "
    "int kv_prefetch_bytes, Tensor out_rows, int num_out_rows, Tensor out_block_tables, Tensor out_seq_lens, "
    "Tensor out_query_start, Tensor out_query_lens, int num_out_seqs, Tensor lora_weights, int lora_slots, "
    "Tensor lora_widths, Tensor lora_rows, Tensor lora_scratch, Tensor state_sizes, Tensor state_limits, "
    "Tensor span_starts, Tensor span_lengths, Tensor span_slots, Tensor span_has_state, int num_spans, "
    "Tensor moe_sizes, float moe_scaling, float moe_eps, Tensor latent_sizes, float latent_eps) -> int32")
_LORA_SCRATCH = NativeFunction("decoder_stack", "kvloom_decoder_stack_lora_scratch(int tokens, int hidden_size, "
                                                "int q_size, int kv_size, int intermediate, int max_width) -> int")

# A layer's row of the weight table, in decoder_stack.cpp's `Weight` order.
WEIGHT_COLUMNS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
                  "down", "down_bias", "q_norm", "k_norm",  # Qwen3's, Gemma 3's per-head norms (0: none)
                  "window",  # a number, not a pointer: the layer's sliding window in keys (0: none)
                  "rope",  # a number, one of ROPE: which rotary table turns the layer's q and k
                  # Gemma 2 and 3's (0: none; with them post_norm is the attention output's own)
                  "pre_ff_norm", "post_ff_norm",
                  "input_norm_bias", "post_norm_bias",  # LayerNorms' biases (norm "layer")
                  "mixer",  # a number, one of MIXERS: the layer's block
                  "kv_layer",  # a number: the KV pool's layer an attention layer writes
                  # A state layer's (mixer "mamba" or "conv"; its in_proj and out_proj in the qkv
                  # and o columns): the convolution's float32 weight [k, channels] and bias (0:
                  # none), the per-slot conv_state (bf16), and a Mamba2 mixer's ssm_state
                  # (float32), dt_bias, A_log, D (float32) and gated norm's weight (bf16).
                  "conv_weight", "conv_bias", "conv_state", "ssm_state", "dt_bias", "A_log", "D", "mixer_norm",
                  # A mixture-of-experts layer's router, packed (0: a dense MLP), and every expert's
                  # packed gate/up and down weights, expert after expert; its gate_up and down
                  # columns then hold a shared expert's (0: none).
                  "router", "experts_gate_up", "experts_down",
                  "router_bias",  # its experts' float32 selection bias (LFM2-MoE's; 0: none)
                  "shared_gate",  # its shared expert's gate, packed [1, hidden] (Qwen2-MoE's; 0: none)
                  # A latent-attention layer's (mixer "latent", DeepSeek's; its query projection, q_proj or
                  # q_b_proj, in the qkv column, o_proj in o): q_a_proj packed and its norm (0: none),
                  # kv_a_proj_with_mqa packed and its norm, every head's packed W_uk^T and W_uv.
                  "q_a", "q_a_norm", "kv_a", "kv_a_norm", "heads_uk", "heads_uv",
                  "mlp_width")  # a number: the layer's MLP features (0: StackShape.intermediate, the widest)
# input_norm 0: OLMo 2's and EXAONE 4's layer (post_norm and post_ff_norm norm each block's
# output before it is added; no norm before the blocks).
# The "rope" column: no rotary (SmolLM3's NoPE layers), the model's, or the windowed layers' own (Gemma 3).
ROPE = {"none": 0, "global": 1, "local": 2}
# The "mixer" column: attention, a Mamba2 mixer (Bamba, Granite 4.0) or LFM2's gated short convolution,
# or none (an MLP alone: Nemotron-H's MLP block after no other). A layer whose gate_up column is 0
# has no MLP.
MIXERS = {"attention": 0, "mamba": 1, "conv": 2, "none": 3, "latent": 4}
# A row's block and conv_state columns: a state layer's must be bound before a call.
_STATE_COLUMNS = [WEIGHT_COLUMNS.index("mixer"), WEIGHT_COLUMNS.index("conv_state")]
_STATE_MIXERS = (MIXERS["mamba"], MIXERS["conv"])
# StackShape.norm and .activation, as decoder_stack.cpp's Norm and Activation codes.
NORMS = {"llama": 0, "scaled_in_float32": 1, "layer": 2}
# "*_plain": the un-gated MLP (its gate_up column holds fc1, its down column fc2), GELU's
# tanh form, its exact one (GPT-NeoX's), ReLU (OPT's) or ReLU squared (Nemotron's, Arcee's).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu_tanh_plain": 2, "gelu_erf_plain": 3, "relu_plain": 4,
               "relu2_plain": 5}
# StackShape.parallel, decoder_stack.cpp's Parallel: blocks in turn (Llama's), or side by side
# with the two outputs added first ((A + M) + S: Phi, GPT-NeoX) or the attention's into the
# stream first ((S + A) + M: StableLM), transformers' orders.
PARALLEL = {"in_turn": 0, "blocks_first": 1, "stream_first": 2}
# A layer's projections in the LoRA table, in decoder_stack.cpp's `Projection` order.
LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")
NUM_KERNELS = 26
KERNEL_LATENT_ATTENTION = 23  # decoder_stack.cpp's K_LATENT_ATTENTION (0 where latent_attention.cpp does not build)


def available() -> bool:
    """Whether decoder_stack.cpp and every kernel it walks build here."""
    return (_STACK.available() and cpu_ops.available() and gemm.GEMM.available()
            and paged_attention.available())


def mixers_available() -> bool:
    """Whether the walk can run state layers here (kvloom/csrc/ssm.cpp builds)."""
    return ssm.available()


def latent_available() -> bool:
    """Whether the walk can run latent-attention layers here (kvloom/csrc/latent_attention.cpp builds)."""
    return latent_attention.available()


def _address(op: NativeOp | NativeFunction, variant: str = "") -> int:
    address = ctypes.cast(op.function(variant), ctypes.c_void_p).value
    assert address is not None, f"kvloom::{op.name} has no entry point"
    return address


def kernel_table(all_reduce: bool = False) -> torch.Tensor:
    """The entry points the walk calls, [NUM_KERNELS] int64, in decoder_stack.cpp's `Kernel` order;
    ``all_reduce``: with the shared-memory all-reduce (tensor parallel), else 0 there."""
    reduce = ctypes.cast(shm_collectives.ALL_REDUCE_STACK.function(), ctypes.c_void_p).value if all_reduce else 0
    return torch.tensor([_address(cpu_ops.RMS_NORM, "bf16"), _address(gemm.GEMM_SIDE), _address(cpu_ops.ROTARY, "bf16"),
                         _address(paged_attention.WRITE_KV_PAIRED), _address(paged_attention.PAGED_ATTENTION),
                         _address(cpu_ops.SILU_AND_MUL, "bf16"), reduce or 0, _address(cpu_ops.ADD_ROWS, "bf16"),
                         _address(cpu_ops.RMS_NORM_SCALED, "bf16"), _address(cpu_ops.GELU_TANH_AND_MUL, "bf16"),
                         _address(cpu_ops.LAYER_NORM, "bf16"), _address(cpu_ops.GELU_TANH, "bf16"),
                         _address(cpu_ops.GELU_ERF, "bf16"), _address(cpu_ops.CLAMP, "bf16"),
                         _address(cpu_ops.RELU, "bf16"), _address(cpu_ops.RELU2, "bf16"),
                         _address(ssm.MAMBA_MIXER, "bf16") if ssm.available() else 0,
                         _address(ssm.SHORT_CONV, "bf16") if ssm.available() else 0,
                         _address(gemm.GEMM_GROUPED), _address(cpu_ops.MOE_ROUTE, "bf16"),
                         _address(cpu_ops.MOE_COMBINE, "bf16"), _address(cpu_ops.SIGMOID_GATE, "bf16"),
                         *((_address(latent_attention.LATENT_ROTARY), _address(latent_attention.LATENT_ATTENTION))
                           if latent_available() else (0, 0)),
                         _address(cpu_ops.ROUTER_LOGITS), _address(cpu_ops.MOE_ROUTE, "f32")],
                        dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class StackShape:
    """The model's sizes the walk needs (one per model)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    isa: str  # the GEMM path of every matmul (kernels/gemm.py)
    residual_scale: float = 1.0  # Granite's: each block's output times it before the residual add
    rotary_dim: int | None = None  # the rotary's dims of each head (Phi-4's part); None: head_dim
    # How every RMSNorm scales (NORMS): Llama's rounds x / rms(x), then times the weight;
    # "scaled_in_float32" times (norm_offset + weight) before its one rounding (Gemma's
    # offset 1, Helium's 0); "layer" is LayerNorm with a weight and a bias.
    norm: str = "llama"
    norm_offset: float = 0.0
    # The MLP's (ACTIVATIONS): SwiGLU, Gemma's GeGLU, or an un-gated GELU's, ReLU's or ReLU squared's.
    activation: str = "silu"
    qk_norm_whole: bool = False  # the q and k norms span a token's whole q and k (OLMo 2), not each head
    # Attention and MLP side by side (PARALLEL; Phi and StableLM: the MLP reads the attention's
    # input, post_norm 0; GPT-NeoX: its own norm of the stream), and the order of the adds.
    # One process.
    parallel: str = "in_turn"
    clip: float = 0.0  # OLMo 1's clip_qkv: q, k and v clamped to [-clip, clip] after the projection; 0: none
    local_rope: bool = False  # some layer's "rope" column is ROPE["local"]: run() then needs local_rotary
    num_kv_layers: int | None = None  # the KV pool's layers (a hybrid's attention layers); None: num_layers
    states: StateShape | None = None  # a hybrid's state layers (some layer's "mixer" column is not attention)
    moe: MoEShape | None = None  # its mixture-of-experts layers' experts (some layer's "router" column is set)
    # Its latent-attention layers (every layer's "mixer" column is "latent"; num_heads, num_kv_heads and
    # head_dim then 0: no Llama attention; rotary_dim the latent's rotary part; the pool the latents').
    latent: LatentShape | None = None


@dataclass(frozen=True, slots=True)
class LatentShape:
    """A model's latent attention (DeepSeek's MLA; csrc/decoder_stack.cpp's LatentShape): ``heads``
    query heads of ``nope`` + ``rope`` dimensions; each token's latent ``rank`` + ``rope`` numbers
    (the pool's entry); each head's value ``v`` wide; ``q_rank`` q_a_proj's rank (0: q_proj alone);
    ``interleaved`` the rotary's adjacent pairs; ``products`` kernels/latent_attention.py's;
    ``uk_stride``, ``uv_stride``: bf16 elements from one head's packed up-projection to the next's;
    ``eps`` the latent's and q_a's norms'."""

    heads: int
    rank: int
    rope: int
    nope: int
    v: int
    q_rank: int
    interleaved: bool
    products: str
    uk_stride: int
    uv_stride: int
    eps: float

    @property
    def dim(self) -> int:
        return self.rank + self.rope


@dataclass(frozen=True, slots=True)
class MoEShape:
    """A model's routed experts, one shape for all its mixture-of-experts layers: kvloom::moe_route's
    rule (``top_k`` of ``num_experts`` by their softmax or, ``sigmoid``, their sigmoid scores,
    each plus its layer's selection bias where it has one; divided by their sum plus ``eps``
    where ``norm``, times ``scaling``, rounded to bf16 where ``round_weights``) and each
    expert's SwiGLU of ``inter`` features; ``gate_up_stride`` and ``down_stride``: bf16
    elements from one expert's packed weight to the next's."""

    num_experts: int
    top_k: int
    inter: int
    gate_up_stride: int
    down_stride: int
    norm: bool
    round_weights: bool
    scaling: float
    sigmoid: bool = False
    eps: float = 0.0
    router_float32: bool = False  # a float32 router weight, its logits kvloom::router_logits' (DeepSeek's)
    # DeepSeek's group-limited choice: the top_k from the topk_groups best of num_groups groups, each
    # scored by cpu_ops.GROUP_RULES[group_rule] ("none": every expert a candidate).
    num_groups: int = 1
    topk_groups: int = 1
    group_rule: str = "none"
    # SwiGLU experts; False: up alone through ReLU squared (Nemotron 3's), the shared expert un-gated too
    gated: bool = True
    # Expert parallel: the rank's experts [first_expert, first_expert + local_experts), whose weights alone
    # the packed tensors hold (the other ranks' pairs left out); None: every expert (num_experts)
    first_expert: int = 0
    local_experts: int | None = None


@dataclass(frozen=True, slots=True)
class StateShape:
    """A hybrid stack's state layers' sizes: every Mamba2 mixer's (kernels/ssm.py
    ``mamba_mixer``'s; heads 0: none) and the taps of LFM2's short convolutions (0: none)."""

    inter: int = 0
    conv_dim: int = 0
    heads: int = 0
    head_dim: int = 0
    d_state: int = 0
    groups: int = 0
    conv_kernel: int = 0
    dt_lo: float = 0.0
    dt_hi: float = 0.0
    eps: float = 0.0  # the gated norm's
    short_kernel: int = 0


@dataclass(frozen=True, slots=True)
class StackSpans:
    """The step's requests as the state layers read them (models/ssm_ops.SSMSpans's tensors): each
    one's first row, row count and state slot ([n] int64), and whether its chunk continues
    the slot's state ([n] int32); ``num_slots``: the state tensors' slots."""

    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    has_state: torch.Tensor
    num_slots: int


@dataclass(frozen=True, slots=True)
class StackRows:
    """The step's sequences, as the attention kernel reads them (int32, contiguous)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start: torch.Tensor  # [num_seqs]
    query_lens: torch.Tensor  # [num_seqs]


@dataclass(frozen=True, slots=True)
class StackOutputs:
    """The rows whose final state the caller reads, and the only ones the last layer's
    attention and MLP compute: ``rows`` ([n] int64, ascending token indices) are the last
    ``sequences.query_lens[s]`` rows of each sequence in ``sequences`` (as the attention
    reads them; ``query_start`` counts kept rows)."""

    rows: torch.Tensor
    sequences: StackRows


@dataclass(frozen=True, slots=True)
class StackLoRA:
    """LoRA adapters in the walk (kvloom/lora/native.py builds it on each load).
    ``weights``: [layers, 4, slots, 2] int64 data pointers of the packed shrink (A,
    [width, in]) and expand (B, [out, width]) weights of each layer's projection
    (LORA_PROJECTIONS order) and adapter slot, 0 and 0 where the slot's adapter leaves
    that projection alone; ``widths``: [4] int64, each projection's shrink width;
    ``owners``: the tensors behind the pointers, alive as long as the table."""

    weights: torch.Tensor
    widths: torch.Tensor
    owners: tuple[torch.Tensor, ...]


def lora_scratch_elements(shape: StackShape, tokens: int, lora: StackLoRA) -> int:
    """bf16 elements of LoRA's scratch in a walk of ``tokens`` rows."""
    return int(_LORA_SCRATCH.function()(tokens, shape.hidden_size, shape.num_heads * shape.head_dim,
                                        shape.num_kv_heads * shape.head_dim, shape.intermediate,
                                        int(lora.widths.max())))


def _fail(argument: str, message: str) -> ValueError:
    return ValueError(f"kvloom decoder_stack: {argument} {message}")


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if (tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous()
            or tensor.device.type != "cpu"):
        raise _fail(name, f"must be a contiguous {list(shape)} {dtype} CPU tensor, got {list(tensor.shape)} "
                          f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}")


def scratch_elements(shape: StackShape, tokens: int) -> int:
    """bf16 elements of the walk's scratch for ``tokens`` rows."""
    states = shape.states
    mixer_width = 0 if states is None else int(_MIXER_WIDTH.function()(states.inter, states.conv_dim, states.heads,
                                                                       shape.hidden_size, states.short_kernel))
    moe = shape.moe
    moe_width = 0 if moe is None else int(_MOE_WIDTH.function()(moe.num_experts, moe.top_k, moe.inter,
                                                                  shape.hidden_size))
    latent = shape.latent
    latent_width = 0 if latent is None else int(_LATENT_WIDTH.function()(latent.heads, latent.rank, latent.rope,
                                                                         latent.nope, latent.v, latent.q_rank))
    return int(_SCRATCH.function()(tokens, shape.hidden_size, shape.num_heads * shape.head_dim,
                                   shape.num_kv_heads * shape.head_dim, shape.intermediate, mixer_width, moe_width,
                                   latent_width))


def run(kernels: torch.Tensor, weights: torch.Tensor, shape: StackShape, residual: torch.Tensor,
        kv_caches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, rows: StackRows,
        scale: float, scratch: torch.Tensor | None = None, reduce: torch.Tensor | None = None,
        split_seqs: int = 0, kv_prefetch_bytes: int = 0, outputs: StackOutputs | None = None,
        lora: StackLoRA | None = None, lora_rows: torch.Tensor | None = None,
        lora_scratch: torch.Tensor | None = None,
        local_rotary: tuple[torch.Tensor, torch.Tensor] | None = None, softcap: float = 0.0,
        spans: StackSpans | None = None) -> torch.Tensor:
    """Run every layer over ``residual`` ([tokens, hidden] bf16, the embeddings; updated
    in place into the stream before the last layer's output) and return that output,
    [tokens, hidden]: the caller's final norm adds it. With ``outputs`` (one walk, no
    reduce), the last layer's attention, o projection and MLP run over its n rows only:
    the result is [n, hidden], and ``residual[:n]`` their stream (the rest of
    ``residual`` is then undefined); each row's bits are what it gets without. ``kv_caches``: the whole pool
    [layers, 2, blocks, block_size, kv_heads, head_dim] in the paired layout.
    ``scratch``: a bf16 buffer of at least ``scratch_elements`` to reuse (else one is
    allocated). ``reduce``: under tensor parallel, the shared-memory all-reduce's
    context (kernels/shm_collectives.py ``CONTEXT_FIELDS``; the kernel table must hold
    its entry point): ``hidden`` is summed over the ranks after the o and down
    projections. ``split_seqs``: 0 for one walk; else two concurrent walks, the first
    ``split_seqs`` sequences and the rest, on half the threads each (no reduce, an even
    thread count; the result is the same bit for bit). ``kv_prefetch_bytes``: how much of
    each layer's KV a walk fetches into cache during the matmuls before its attention
    (0: none; csrc/decoder_stack.cpp says where it pays; the same result bit for bit).
    ``lora`` with ``lora_rows`` ([tokens] int32, each row's adapter slot, -1 the base
    model): each slot's delta added to its rows after each matmul, as LoRALinear's (the
    last layer's kept rows' only, with ``outputs``); ``lora_scratch``: a bf16 buffer of
    at least ``lora_scratch_elements`` to reuse. ``local_rotary``: (cos, sin) of the layers
    whose "rope" column is ROPE["local"], shaped as ``cos`` and ``sin`` (Gemma 3's windowed
    layers). ``softcap``: the attention scores' cap (Gemma 2's; 0: none), as ``scale`` the
    attention backend's. ``spans``: with ``shape.states`` (a hybrid), the step's requests as its
    state layers read them, one a sequence in order; their states move on in their slots."""
    tokens = residual.shape[0]
    bf16 = torch.bfloat16
    _check("kernels", kernels, torch.int64, (NUM_KERNELS,))
    if reduce is not None:
        _check("reduce", reduce, torch.int64, (len(shm_collectives.CONTEXT_FIELDS),))
        if int(kernels[6]) == 0:
            raise _fail("kernels", "have no all-reduce entry point, but a reduce context was given")
    _check("weights", weights, torch.int64, (shape.num_layers, len(WEIGHT_COLUMNS)))
    _check("residual", residual, bf16, (tokens, shape.hidden_size))
    if kv_caches.dim() != 6:
        raise _fail("kv_caches", f"must be [layers, 2, blocks, block_size, kv_heads, head_dim], got "
                                 f"{list(kv_caches.shape)}")
    num_blocks, block_size = kv_caches.shape[2], kv_caches.shape[3]
    latent = shape.latent
    if latent is not None:  # the latents' pool, token-major
        if int(kernels[KERNEL_LATENT_ATTENTION]) == 0:
            raise _fail("kernels", "have no latent attention entry point (kvloom/csrc/latent_attention.cpp)")
        if latent.products not in latent_attention.supported_products():
            raise _fail("shape", f"asks for the latent attention's {latent.products!r} products; this CPU runs "
                                 f"{latent_attention.supported_products()}")
        _check("kv_caches", kv_caches, bf16, (shape.num_layers, 1, num_blocks, block_size, 1, latent.dim))
    else:
        _check("kv_caches", kv_caches, bf16, (shape.num_layers if shape.num_kv_layers is None
                                              else shape.num_kv_layers, 2, num_blocks, block_size,
                                              shape.num_kv_heads, shape.head_dim))
        if not paged_attention.paired_layout(shape.head_dim, block_size):
            raise _fail("kv_caches", f"of block size {block_size} and head_dim {shape.head_dim} has no paired "
                                     "layout here")
    _check("cos", cos, torch.float32, (tokens, shape.rotary_dim or shape.head_dim))
    _check("sin", sin, torch.float32, (tokens, shape.rotary_dim or shape.head_dim))
    if local_rotary is not None:
        _check("local cos", local_rotary[0], torch.float32, (tokens, shape.rotary_dim or shape.head_dim))
        _check("local sin", local_rotary[1], torch.float32, (tokens, shape.rotary_dim or shape.head_dim))
    elif shape.local_rope:
        raise _fail("local_rotary", "must be given: some layers turn by the local rotary table")
    if shape.norm not in NORMS or shape.activation not in ACTIVATIONS or shape.parallel not in PARALLEL:
        raise _fail("shape", f"has norm {shape.norm!r} (one of {sorted(NORMS)}), activation "
                             f"{shape.activation!r} (one of {sorted(ACTIVATIONS)}) and parallel "
                             f"{shape.parallel!r} (one of {sorted(PARALLEL)})")
    if not softcap >= 0:
        raise _fail("softcap", f"must be 0 (none) or positive, got {softcap}")
    _check("slots", slots, torch.int64, (tokens,))
    num_seqs = rows.block_tables.shape[0]
    _check("block_tables", rows.block_tables, torch.int32, (num_seqs, rows.block_tables.shape[1]))
    for name in ("seq_lens", "query_start", "query_lens"):
        _check(name, getattr(rows, name), torch.int32, (num_seqs,))
    threads = torch.get_num_threads()
    if split_seqs and not (0 < split_seqs < num_seqs and threads >= 2 and threads % 2 == 0 and reduce is None):
        raise _fail("split_seqs", f"must be 0, or within (0, {num_seqs}) with an even thread count (have "
                                  f"{threads}) and no reduce context, got {split_seqs}")
    if kv_prefetch_bytes < 0:
        raise _fail("kv_prefetch_bytes", f"must be >= 0, got {kv_prefetch_bytes}")
    out_rows, out_seqs = -1, 0
    if outputs is not None:
        if split_seqs or reduce is not None:
            raise _fail("outputs", "need one walk without a reduce context (split_seqs 0, reduce None)")
        out_rows, out_seqs = outputs.rows.shape[0], outputs.sequences.block_tables.shape[0]
        _check("outputs.rows", outputs.rows, torch.int64, (out_rows,))
        _check("outputs.block_tables", outputs.sequences.block_tables, torch.int32,
               (out_seqs, rows.block_tables.shape[1]))
        for name in ("seq_lens", "query_start", "query_lens"):
            _check(f"outputs.{name}", getattr(outputs.sequences, name), torch.int32, (out_seqs,))
        # The kernel moves rows forward in place and reads the attention's indices as
        # given: what it could not survive is refused here, once per step.
        kept = outputs.rows.tolist()
        ascending = all(a < b for a, b in zip(kept, kept[1:], strict=False))
        if not ascending or (kept and not 0 <= kept[0] <= kept[-1] < tokens):
            raise _fail("outputs.rows", f"must be ascending token indices in [0, {tokens}), got {kept}")
        if int(outputs.sequences.query_lens.sum()) != out_rows:
            raise _fail("outputs.query_lens", f"must sum to the {out_rows} rows")
    state_args, state_held = _state_args(shape, weights, spans, split_seqs, tokens, num_seqs)  # alive through the call
    lora_args = [0, 0, 0, 0, 0]
    if lora is not None:
        adapter_slots = lora.weights.shape[2] if lora.weights.dim() == 4 else 0
        _check("lora.weights", lora.weights, torch.int64, (shape.num_layers, len(LORA_PROJECTIONS), adapter_slots, 2))
        _check("lora.widths", lora.widths, torch.int64, (len(LORA_PROJECTIONS),))
        if lora_rows is None:
            raise _fail("lora_rows", "must be given with lora")
        _check("lora_rows", lora_rows, torch.int32, (tokens,))
        if tokens and not (-1 <= int(lora_rows.min()) and int(lora_rows.max()) < adapter_slots):
            raise _fail("lora_rows", f"must be slots in [-1, {adapter_slots}), got {lora_rows.tolist()}")
        lora_needed = lora_scratch_elements(shape, tokens, lora)
        if lora_scratch is None:
            lora_scratch = torch.empty(lora_needed, dtype=bf16)
        elif (lora_scratch.dtype != bf16 or lora_scratch.dim() != 1 or lora_scratch.numel() < lora_needed
              or not lora_scratch.is_contiguous()):
            raise _fail("lora_scratch", f"must be a contiguous 1-D bf16 tensor of at least {lora_needed} elements, "
                                        f"got {list(lora_scratch.shape)} {lora_scratch.dtype}")
        lora_args = [lora.weights.data_ptr(), adapter_slots, lora.widths.data_ptr(), lora_rows.data_ptr(),
                     lora_scratch.data_ptr()]
    needed = scratch_elements(shape, tokens)
    if scratch is None:
        scratch = torch.empty(needed, dtype=bf16)
    elif scratch.dtype != bf16 or scratch.dim() != 1 or scratch.numel() < needed or not scratch.is_contiguous():
        raise _fail("scratch", f"must be a contiguous 1-D bf16 tensor of at least {needed} elements, got "
                               f"{list(scratch.shape)} {scratch.dtype}")
    hidden = torch.empty_like(residual)
    with profiled("kvloom::decoder_stack"):
        status = _STACK.function()(
            kernels.data_ptr(), weights.data_ptr(), shape.num_layers, residual.data_ptr(), hidden.data_ptr(),
            scratch.data_ptr(), kv_caches.data_ptr(), num_blocks, cos.data_ptr(), sin.data_ptr(),
            *((0, 0) if local_rotary is None else (local_rotary[0].data_ptr(), local_rotary[1].data_ptr())),
            slots.data_ptr(),
            rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.seq_lens.data_ptr(),
            rows.query_start.data_ptr(), rows.query_lens.data_ptr(), num_seqs, tokens, shape.hidden_size,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rotary_dim or shape.head_dim,
            shape.intermediate, block_size, shape.eps, scale, shape.residual_scale, softcap,
            NORMS[shape.norm], shape.norm_offset, ACTIVATIONS[shape.activation], int(shape.qk_norm_whole),
            PARALLEL[shape.parallel], shape.clip,
            gemm.isa_code(shape.isa), threads, 0 if reduce is None else reduce.data_ptr(), split_seqs,
            kv_prefetch_bytes, 0 if outputs is None else outputs.rows.data_ptr(), out_rows,
            *([0] * 4 if outputs is None else [getattr(outputs.sequences, name).data_ptr() for name in
                                               ("block_tables", "seq_lens", "query_start", "query_lens")]), out_seqs,
            *lora_args, *state_args, *_moe_args(shape.moe), *_latent_args(latent))
    if status == -4:
        raise RuntimeError("kvloom decoder_stack: the latent attention kernel refused the step (its products or "
                           "shape)")
    if status == -3:
        raise RuntimeError("kvloom decoder_stack: a state layer's kernel refused the step's requests (a slot out "
                           "of range, or spans outside the rows)")
    if status == -2:
        raise RuntimeError("kvloom decoder_stack: tensor-parallel all-reduce: another rank of this host died")
    if status == -1:
        raise RuntimeError("kvloom decoder_stack: tensor-parallel all-reduce: timed out waiting for another rank")
    if status != 0:
        raise RuntimeError(f"kvloom decoder_stack: layer {status - 1}'s matmul refused the {shape.isa!r} path "
                           f"(this CPU runs {gemm.supported_isas()})")
    return hidden if outputs is None else hidden[:out_rows]


def _state_args(shape: StackShape, weights: torch.Tensor, spans: StackSpans | None, split_seqs: int, tokens: int,
                num_seqs: int) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """The C call's state-layer arguments (sizes, limits, the spans' four arrays and their
    count), zeros without state layers, and the tensors behind the first two, which the caller
    keeps alive through the call; ValueError naming what the state layers cannot take."""
    states = shape.states
    if states is None:
        return [0] * 7, ()
    if spans is None:
        raise _fail("spans", "must be given: the model's layers keep states")
    n = spans.starts.shape[0]
    if split_seqs and n != num_seqs:  # each walk takes its sequences' spans
        raise _fail("spans", f"must be one a sequence ({num_seqs}) where the walks split, got {n}")
    for name, dtype in (("starts", torch.int64), ("lengths", torch.int64), ("slots", torch.int64),
                        ("has_state", torch.int32)):
        _check(f"spans.{name}", getattr(spans, name), dtype, (n,))
    if int(spans.lengths.sum()) != tokens:
        raise _fail("spans.lengths", f"must sum to the step's {tokens} rows, got {spans.lengths.tolist()}")
    if any(mixer in _STATE_MIXERS and not conv_state for mixer, conv_state in weights[:, _STATE_COLUMNS].tolist()):
        raise _fail("weights", "have a state layer without its state tensors (bound at the first step)")
    sizes, limits = _state_sizes(states, spans.num_slots)
    return [sizes.data_ptr(), limits.data_ptr(), spans.starts.data_ptr(), spans.lengths.data_ptr(),
            spans.slots.data_ptr(), spans.has_state.data_ptr(), n], (sizes, limits)


def _moe_args(moe: MoEShape | None) -> tuple[int, float, float]:
    """The C call's moe_sizes pointer (0: no mixture-of-experts layer), moe_scaling and moe_eps."""
    return (0, 1.0, 0.0) if moe is None else (_moe_sizes(moe).data_ptr(), moe.scaling, moe.eps)


def _latent_args(latent: LatentShape | None) -> tuple[int, float]:
    """The C call's latent_sizes pointer (0: no latent-attention layer) and latent_eps."""
    return (0, 0.0) if latent is None else (_latent_sizes(latent).data_ptr(), latent.eps)


@functools.lru_cache(maxsize=8)
def _latent_sizes(latent: LatentShape) -> torch.Tensor:
    """The C call's latent_sizes array, made once per model (the C side only reads it)."""
    return torch.tensor([latent.heads, latent.rank, latent.rope, latent.nope, latent.v, latent.q_rank,
                         int(latent.interleaved), latent_attention.PRODUCTS.index(latent.products),
                         latent.uk_stride, latent.uv_stride], dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def _moe_sizes(moe: MoEShape) -> torch.Tensor:
    """The C call's moe_sizes array, made once per model (the C side only reads it)."""
    return torch.tensor([moe.num_experts, moe.top_k, moe.inter, moe.gate_up_stride, moe.down_stride, int(moe.norm),
                         int(moe.round_weights), int(moe.sigmoid), int(moe.router_float32), moe.num_groups,
                         moe.topk_groups, cpu_ops.GROUP_RULES[moe.group_rule], int(moe.gated), moe.first_expert,
                         moe.num_experts if moe.local_experts is None else moe.local_experts], dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def _state_sizes(states: StateShape, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The C call's state_sizes (int64) and state_limits (float32) arrays, made once per model
    and slot count (the C side only reads them)."""
    return (torch.tensor([states.inter, states.conv_dim, states.heads, states.head_dim, states.d_state, states.groups,
                          states.conv_kernel, states.short_kernel, num_slots], dtype=torch.int64),
            torch.tensor([states.dt_lo, states.dt_hi, states.eps], dtype=torch.float32))
