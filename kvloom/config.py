"""Frozen configuration dataclasses. Validation lives in ``__post_init__`` and every
message names the field, so a bad CLI flag and a bad ``LLM(...)`` keyword read alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
MATMULS = ("invariant", "onednn", "torch")  # EngineConfig.matmul (models/packed_linear.py)
SCHEDULING_MODES = ("continuous", "static")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, normalised from any HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Kept as a sorted tuple of items so the config stays hashable and frozen.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral shapes)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("model config: config.json has no 'architectures' entry")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling") or None
        # transformers >= 5 stores rope settings under "rope_parameters".
        rope_params = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = tuple(sorted(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in rope_scaling.items()
            ))
        arch = archs[0]
        # Qwen2 always has q/k/v bias; Llama and Mistral use the attention_bias flag.
        attention_bias = bool(hf.get("attention_bias", arch.startswith("Qwen2")))
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. ``num_blocks`` wins over ``kv_cache_memory`` (GiB)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if not isinstance(self.kv_cache_memory, (int, float)) or self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 (GiB), got {self.kv_cache_memory!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the scheduling policy. The scheduler thinks in tokens."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling: str = "continuous"
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Largest prefill chunk one request may take in a step (0: the whole budget).
    long_prefill_threshold: int = 0
    # A waiting request older than this many steps is admitted first (0: off).
    max_wait_steps: int = 0
    max_wait_seconds: float = 0.0
    # Watermark admission control, as fractions of the KV pool in use.
    low_watermark: float = 0.0
    high_watermark: float = 1.0
    trace: bool = False
    trace_capacity: int = 10000

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("long_prefill_threshold", "max_wait_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {self.scheduling!r}")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1, got "
                f"low_watermark={self.low_watermark}, high_watermark={self.high_watermark}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine. CLI flags map 1:1 onto these names."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    attention_backend: str = "auto"
    num_threads: int | None = None
    # The kernel behind CPU bf16 matmuls (models/packed_linear.py): "invariant" (ours: a
    # row's result never depends on the batch), "onednn" (prepacked oneDNN: its kernel,
    # and so the rounding, changes with the number of rows) or "torch" (F.linear).
    matmul: str = "invariant"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")

    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(num_blocks=...)``, CLI flags)."""
        cache_fields = set(CacheConfig.__dataclass_fields__)
        sched_fields = set(SchedulerConfig.__dataclass_fields__)
        engine_fields = set(cls.__dataclass_fields__) - {"cache", "scheduler", "model"}
        cache_kw, sched_kw, engine_kw = {}, {}, {}
        for key, value in kwargs.items():
            if key in cache_fields:
                cache_kw[key] = value
            elif key in sched_fields:
                sched_kw[key] = value
            elif key in engine_fields:
                engine_kw[key] = value
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        return cls(model=model, cache=CacheConfig(**cache_kw),
                   scheduler=SchedulerConfig(**sched_kw), **engine_kw)
