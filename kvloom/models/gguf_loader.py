"""GGUF checkpoints: metadata -> HF config, tensors -> dequantized HF parameters.

Every tensor is dequantized to float32 with ``gguf.quants``; the engine never runs
quantized kernels. llama.cpp's converter reorders the rows of Q and K in llama-family
models (its rotary kernel pairs adjacent dimensions, HF pairs the two halves of each
head); ``_unpermute_rows`` restores HF's order. Qwen2 GGUFs are stored unpermuted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloom.models.errors import ModelLoadError
from kvloom.tokenizer import Tokenizer

# GGUF general.architecture -> (HF architectures[0], HF model_type, Q/K permuted?)
GGUF_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed into the config (llama3 rope scaling), not a parameter.
_METADATA_TENSORS = {"rope_freqs.weight"}


def open_gguf(path: Path) -> Any:
    """Parse a GGUF file's header (tensor data stays memory-mapped)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/memmap errors, ...
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {exc}") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: tensor "
                                 f"{tensor.name} is cut short")
    return reader


def gguf_architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    return arch


def gguf_hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """Synthesize a config.json-like dict from ``<arch>.*`` metadata."""
    arch = gguf_architecture(reader, path)
    hf_arch, model_type, _ = GGUF_ARCHITECTURES[arch]
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    try:
        hidden = int(meta("embedding_length"))
        num_heads = int(meta("attention.head_count"))
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": int(meta("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
            "intermediate_size": int(meta("feed_forward_length")),
            "head_dim": int(meta("attention.key_length", hidden // num_heads)),
            # GGUF shapes are innermost-first: token_embd is [hidden, vocab].
            "vocab_size": shapes["token_embd.weight"][-1],
            "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(meta("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in shapes,
            "torch_dtype": "float32",
        }
    except (TypeError, KeyError) as exc:
        raise ModelLoadError(f"GGUF file {path} lacks required metadata ({exc})") from None
    if arch == "qwen2":
        config["attention_bias"] = True
    window = meta("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    config["rope_scaling"] = _rope_scaling(reader, arch, config, path)
    return config


def gguf_weights(reader: Any, arch: str, hf_config: dict[str, Any]
                 ) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """A re-iterable source of (HF name, float32 tensor), dequantized one at a time."""
    _, _, permuted = GGUF_ARCHITECTURES[arch]
    head_counts = {"self_attn.q_proj.weight": hf_config["num_attention_heads"],
                   "self_attn.k_proj.weight": hf_config["num_key_value_heads"]}

    def iterate() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            if tensor.name in _METADATA_TENSORS:
                continue
            name = hf_name(tensor.name)
            array = dequantize(tensor)
            suffix = name.split(".", 3)[-1]
            if permuted and suffix in head_counts:
                array = _unpermute_rows(array, head_counts[suffix])
            yield name, torch.from_numpy(np.ascontiguousarray(array))

    return iterate


def num_weights(reader: Any) -> int:
    """How many tensors ``gguf_weights`` yields."""
    return sum(tensor.name not in _METADATA_TENSORS for tensor in reader.tensors)


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF parameter name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")


def dequantize(tensor: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 in torch's (outermost-first) shape."""
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor {tensor.name} uses quantization "
                             f"{tensor.tensor_type.name}, which gguf cannot dequantize") from None
    array = array.astype(np.float32, copy=False).reshape(shape)
    # F32 tensors come back as views of the read-only memory map; torch needs a
    # writable buffer, and callers must not keep the file mapped through them.
    return array if array.flags.writeable else array.copy()


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Within each head, llama.cpp stores row
    ``2*i + j`` for HF row ``j*half + i`` (i < half = head_dim/2, j in {0, 1})."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [num_heads, half, 2, in] -> [num_heads, 2, half, in] -> [rows, in]
    return weight.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of ``_unpermute_rows``); for tests that
    write GGUF files the way llama.cpp's converter does."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [num_heads, 2, half, in] -> [num_heads, half, 2, in] -> [rows, in]
    return weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(rows, -1)


def gguf_tokenizer(reader: Any, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(reader)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build the tokenizer of {path}: {exc}") from None


def _rope_scaling(reader: Any, arch: str, config: dict[str, Any], path: Path
                  ) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        return _llama3_scaling(dequantize(rope_freqs), config, path)
    return None


def _llama3_scaling(freq_factors: np.ndarray, config: dict[str, Any], path: Path
                    ) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1-style rope scaling as per-dimension divisors of the
    rotary frequencies, not as parameters. Recover the parameters by matching the
    published settings (Llama 3.1: factor 8; Llama 3.2: factor 32)."""
    dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for factor in (8.0, 32.0, 16.0, 4.0):
        candidate = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        scaled = _llama3_inv_freq(inv_freq, candidate)
        if np.allclose(inv_freq / scaled, freq_factors, rtol=1e-3):
            return candidate
    raise ModelLoadError(f"GGUF file {path} has rope_freqs that match no known "
                         "llama3 rope scaling")


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth == 1: high frequency, unchanged; smooth == 0: low frequency, / factor.
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value.item() if hasattr(value, "item") else value
